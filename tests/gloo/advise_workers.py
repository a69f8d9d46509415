"""Rank-side bodies of ``test_advise_memory.py``: the per-rank memory of a real training step.

For a small Llama (float32), parallelized over all ranks with each activation-checkpointing
mode, and at 4 ranks also as TP 2 x FSDP2 2 on a (dp, tp) mesh: the bytes of this rank's
parameters, of its gradients after one backward, of AdamW's state after one step, and what
the forward leaves alive for backward (:func:`tpcompile.inspect.advise.retained.retained_bytes`).
"""

from __future__ import annotations

import torch

import tpcompile
from tpcompile.inspect.advise.retained import retained_bytes
from tpcompile.tools import models

CONFIG = {"n_layers": 2, "dim": 128, "hidden": 512, "n_heads": 8, "n_kv_heads": 2,
          "vocab": 256, "max_seq": 64}
BATCH, SEQ = 4, 64


def build():
    """The model (random init, seed 0) and the global batch."""
    torch.manual_seed(0)
    model = models.build("llama", **CONFIG)
    return model, models.example_inputs(model, BATCH, SEQ)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def _step(module, inputs, activations: bool) -> dict:
    """One forward (its retained bytes), backward and AdamW step; the bytes of each part."""
    held = [*module.parameters(), *module.buffers(), *inputs]
    retained = retained_bytes(lambda: module(*inputs), held) if activations else None
    module(*inputs).float().sum().backward()
    opt = torch.optim.AdamW(module.parameters())
    opt.step()
    params = list(module.parameters())
    return {"params": _nbytes(params), "grads": _nbytes(p.grad for p in params),
            "optimizer": _nbytes(t for s in opt.state.values() for t in s.values()),
            "activations": retained}


def _fsdp(model, inputs) -> dict:
    """TP 2 x FSDP2 2 on a (dp, tp) mesh of 4 ranks, each dp rank on its half of the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    local = inputs[0].chunk(2)[mesh["dp"].get_local_rank()]
    tp = tpcompile.parallelize(model, (local,), mesh=mesh["tp"])
    tpcompile.fully_shard_blocks(tp, mesh["dp"])
    return _step(tp, (local,), activations=False)


def memory(rank: int, world_size: int, cases: list[str]) -> dict:
    """``cases``: checkpointing modes ("none", "selective", "full") over all ranks, "fsdp"."""
    model, inputs = build()
    out = {}
    for case in cases:
        if case == "fsdp":
            out[case] = _fsdp(model, inputs)
            continue
        mode = None if case == "none" else case
        tp = tpcompile.parallelize(model, inputs, activation_checkpointing=mode)
        out[case] = _step(tp, inputs, activations=True)
    return out
