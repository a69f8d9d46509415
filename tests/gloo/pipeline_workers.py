"""Rank-side body of ``test_pipeline.py``: TP inside pipeline stages (pp 2 x tp 2, 4 ranks).

The built-in Llama is cut into two stage modules that keep the full model's parameter names
(stage 0: embedding and block 0; stage 1: block 1, final norm, head). Each pp rank
``parallelize``s its stage over its tp sub-mesh, and ``torch.distributed.pipelining`` runs
GPipe over 2 microbatches. Losses and every gradient are compared with the unsharded model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

import tpcompile
from tpcompile.tools import models

CFG = dict(dim=32, hidden=64, n_layers=2, vocab=64)
BATCH, SEQ, MICROBATCHES = 4, 8, 2


class FirstStage(nn.Module):
    def __init__(self, full: models.Llama):
        super().__init__()
        self.tok_embeddings = full.tok_embeddings
        self.layers = nn.ModuleDict({"0": full.layers[0]})
        self.register_buffer("rope_cos", full.rope_cos, persistent=False)
        self.register_buffer("rope_sin", full.rope_sin, persistent=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        return self.layers["0"](self.tok_embeddings(tokens), self.rope_cos[:T], self.rope_sin[:T])


class LastStage(nn.Module):
    def __init__(self, full: models.Llama):
        super().__init__()
        self.layers = nn.ModuleDict({"1": full.layers[1]})
        self.norm, self.output = full.norm, full.output
        self.register_buffer("rope_cos", full.rope_cos, persistent=False)
        self.register_buffer("rope_sin", full.rope_sin, persistent=False)

    def forward(self, h):
        T = h.shape[1]
        return self.output(self.norm(self.layers["1"](h, self.rope_cos[:T], self.rope_sin[:T])))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, CFG["vocab"]), targets.reshape(-1))


def _full_grad(tp, name: str, grad: torch.Tensor) -> torch.Tensor:
    local = grad.full_tensor() if isinstance(grad, DTensor) else grad  # FSDP2's dp rows
    entry = tp.plan.by_fqn.get(name)
    return tpcompile.gather_full(local, None if entry is None else entry.placement, tp.plan, tp.group)


def pp_tp(rank: int, world_size: int, dp: int = 1) -> dict:
    """pp 2 x tp 2, or with ``dp`` 2 pp 2 x dp 2 x tp 2 (FSDP2 over dp inside each stage)."""
    mesh = init_device_mesh("cpu", (2, dp, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage_index, k = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    tokens = torch.randint(0, CFG["vocab"], (BATCH * dp, SEQ), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)

    reference = models.build("llama", **CFG)
    ref_losses = [loss_fn(reference(t), y) for t, y in zip(tokens.chunk(MICROBATCHES * dp),
                                                           targets.chunk(MICROBATCHES * dp))]
    # GPipe scales gradients by 1 / microbatches, FSDP2 averages them over dp
    (sum(ref_losses) / (MICROBATCHES * dp)).backward()
    ref_losses = ref_losses[k * MICROBATCHES:(k + 1) * MICROBATCHES]  # this dp rank's
    tokens, targets = tokens.chunk(dp)[k], targets.chunk(dp)[k]

    full = models.build("llama", **CFG)
    micro = BATCH // MICROBATCHES
    if stage_index == 0:
        stage_module, example = FirstStage(full), tokens[:micro]
    else:
        stage_module, example = LastStage(full), torch.zeros(micro, SEQ, CFG["dim"])
    tp = tpcompile.parallelize(stage_module, (example,), mesh=mesh["tp"])
    if dp > 1:
        fully_shard(tp, mesh=mesh["dp"])
    # shapes inferred at the first step; see docs/scaling.md for explicit input_args/output_args
    stage = PipelineStage(tp, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn)
    losses: list = []
    if stage_index == 0:
        schedule.step(tokens)
    else:
        schedule.step(target=targets, losses=losses)
    grads = {n: _full_grad(tp, n, p.grad) for n, p in tp.named_parameters()}
    want = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in reference.parameters())
    return {
        "stage": stage_index,
        "losses": [l.item() for l in losses],
        "ref_losses": [l.item() for l in ref_losses],
        "grad_err": {n: (g - want[n].grad).abs().max().item() / scale for n, g in grads.items()},
        "names": sorted(grads),
    }
