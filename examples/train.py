"""Train the built-in Llama with tensor parallelism, checkpointing with DCP.

    torchrun --nproc-per-node 2 examples/train.py --steps 20 --checkpoint /tmp/tp-ckpt

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

import tpcompile
from tpcompile.state import checkpoint
from tpcompile.tools import models

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--load", default=None, help="a .safetensors file of the full model")
args = parser.parse_args()

dist.init_process_group("gloo")  # "nccl" on GPUs
rank = dist.get_rank()
cfg = dict(dim=128, hidden=256, n_layers=2, vocab=256)

with torch.device("meta"):
    model = models.build("llama", **cfg)
tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
tp = tpcompile.parallelize(model, (tokens,))
rope = tpcompile.buffers_of(lambda: models.build("llama", **cfg))  # non-persistent buffers
if args.load:
    tpcompile.load_full_state_dict(tp, args.load, buffers=rope)
else:
    torch.manual_seed(0)  # the same seed on every rank: the shards agree
    tpcompile.init_shards(tp, model, buffers=rope)
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
    if rank == 0 and step % 5 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}")

if args.checkpoint:
    checkpoint.save(tp, args.checkpoint, optimizer=opt)
params = sum(t.numel() * t.element_size() for t in tp.state_dict().values())
print(f"rank {rank}: {params / 2**20:.2f} MiB of parameters, final loss {loss.item():.4f}")
dist.destroy_process_group()
