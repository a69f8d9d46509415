"""``advise``'s memory column against the per-rank memory of a real training step on gloo
ranks (bodies in ``advise_workers.py``): parameters, gradients, AdamW state and the
activations the forward leaves for backward, at 2 and 4 ranks with each checkpointing mode,
and parameters, gradients and optimizer state of TP 2 x FSDP2 2 on 4 ranks. Each estimate is
within 15% of the largest rank's measured bytes. CI runs the 2-rank case (~35 s on 2 busy
cores); the 4-rank ones are marked slow: ``python -m pytest -m slow
tests/gloo/test_advise_memory.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gloo import advise_workers as w
from tpcompile.inspect.advise.advise import advise
from tpcompile.inspect.advise.costs import CostModel
from tpcompile.passes.planner.devices import DEVICES
from tpcompile.tools import models
from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

BODIES = str(Path(__file__).parent / "advise_workers.py")
PARTS = ("params", "grads", "optimizer", "activations")
TOLERANCE = 0.15


def _estimates(world_size: int):
    """advise for the workers' model and global batch on ``world_size`` GPUs: its example
    batch is one data-parallel rank's at TP 1, the global batch / world size."""
    with torch.device("meta"):
        model = models.build("llama", **w.CONFIG)
    inputs = models.example_inputs(model, w.BATCH // world_size, w.SEQ)
    return advise(model, inputs, world_size, CostModel(DEVICES["h100"]),
                  sequence_parallel=(False,)).configs


def _pick(configs, **want):
    return next(c for c in configs if all(getattr(c, k) == v for k, v in want.items()))


def _estimated(row) -> dict:
    return {"params": row.param_bytes, "grads": row.grad_bytes,
            "optimizer": row.optimizer_bytes, "activations": row.activation_bytes}


def _check(measured: list[dict], estimate: dict, parts=PARTS) -> None:
    for part in parts:
        most = max(m[part] for m in measured)
        assert abs(estimate[part] - most) <= TOLERANCE * most, (part, estimate[part], most)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_with_each_checkpointing_mode(world_size):
    """TP over all ranks; the 4-rank case is slow (as the FSDP2 one)."""
    modes = ["none", "selective", "full"]
    ranks = run_on_ranks(f"{BODIES}:memory", world_size, modes, timeout=300)
    configs = _estimates(world_size)
    for mode in modes:
        row = _pick(configs, tp=world_size, fsdp=False, checkpointing=mode, sp=False)
        _check([r[mode] for r in ranks], _estimated(row))
    none, full = (_pick(configs, tp=world_size, checkpointing=m, sp=False) for m in ("none", "full"))
    assert full.activation_bytes * 2 < none.activation_bytes  # checkpointing is visible


@pytest.mark.slow
def test_tp2_fsdp2_shards():
    """TP 2 x FSDP2 2 on 4 ranks: parameters, gradients and AdamW state of each rank's shards
    (slow: 4 ranks on CI's 2 cores; python -m pytest -m slow tests/gloo/test_advise_memory.py)."""
    ranks = run_on_ranks(f"{BODIES}:memory", 4, ["fsdp"], timeout=300)
    configs = _estimates(4)
    row = _pick(configs, tp=2, fsdp=True, checkpointing="none", sp=False)
    _check([r["fsdp"] for r in ranks], _estimated(row), PARTS[:3])
    replicated = _pick(configs, tp=2, fsdp=False, checkpointing="none", sp=False)
    assert row.param_bytes * 2 == pytest.approx(replicated.param_bytes, rel=0.02)
