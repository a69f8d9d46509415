"""Train the built-in Llama with tensor parallelism, checkpointing with DCP.

    torchrun --nproc-per-node 2 examples/train.py --steps 20 --checkpoint /tmp/tp-ckpt
    torchrun --nproc-per-node 4 examples/train.py --dp 2 --tp 2   # TP inside, FSDP2 across

With ``--dp N`` the ranks form an (N, world/N) mesh named ("dp", "tp"): the model is
parallelized over ``mesh["tp"]``, each block and then the root are ``fully_shard``-ed over
``mesh["dp"]`` (docs/scaling.md), and each dp rank trains on its slice of the batch.

Builds the model on the meta device (no rank ever holds the whole model), fills the shards
with the modules' own initialisers (or from --load, a safetensors file of the full model),
trains with AdamW and global-norm clipping, and saves a sharded checkpoint (model and optimizer
state) that loads at any world size. Run it again with the same --checkpoint to resume.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import tpcompile
from tpcompile.state import checkpoint
from tpcompile.state.chunks import local_of
from tpcompile.tools import models

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--load", default=None, help="a .safetensors file of the full model")
parser.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) degree")
parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default world/dp)")
args = parser.parse_args()

dist.init_process_group("gloo")  # "nccl" on GPUs
rank, world = dist.get_rank(), dist.get_world_size()
tp_size = args.tp or world // args.dp
if args.dp * tp_size != world:
    raise SystemExit(f"--dp {args.dp} x --tp {tp_size} != {world} ranks")
mesh = init_device_mesh("cpu", (args.dp, tp_size), mesh_dim_names=("dp", "tp"))
cfg = dict(dim=128, hidden=256, n_layers=2, vocab=256)

with torch.device("meta"):
    model = models.build("llama", **cfg)
tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
tokens = tokens.chunk(args.dp)[mesh["dp"].get_local_rank()]  # this dp rank's batch
tp = tpcompile.parallelize(model, (tokens,), mesh=mesh["tp"])
rope = tpcompile.buffers_of(lambda: models.build("llama", **cfg))  # non-persistent buffers
if args.load:
    tpcompile.load_full_state_dict(tp, args.load, buffers=rope)
else:
    torch.manual_seed(0)  # the same seed on every rank: the shards agree
    tpcompile.init_shards(tp, model, buffers=rope)
if args.dp > 1:  # FSDP2 over dp: fully_shard each block, then the root, as torchtitan does
    tpcompile.fully_shard_blocks(tp, mesh["dp"])
opt = torch.optim.AdamW(tp.parameters(), lr=1e-2)
if args.checkpoint and os.path.exists(args.checkpoint):
    checkpoint.load(tp, args.checkpoint, optimizer=opt)  # saved at any world size
for step in range(args.steps):
    logits = tp(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    norm = tpcompile.clip_grad_norm_(tp, max_norm=1.0)
    opt.step()
    if args.dp > 1:  # the global batch's loss
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        loss /= args.dp
    if rank == 0 and step % 5 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}")

if args.checkpoint:
    checkpoint.save(tp, args.checkpoint, optimizer=opt)
params = sum(local_of(t).numel() * t.element_size() for t in tp.state_dict().values())
print(f"rank {rank}: {params / 2**20:.2f} MiB of parameters, final loss {loss.item():.4f}")
dist.destroy_process_group()
