"""``advise``'s memory column against the per-rank memory of a real training step on gloo
ranks (bodies in ``advise_workers.py``): parameters, gradients, AdamW state and the
activations the forward leaves for backward, at 2 and 4 ranks with each checkpointing mode,
and parameters, gradients and optimizer state of TP 2 x FSDP2 2 on 4 ranks. Each estimate is
within 15% of the largest rank's measured bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gloo import advise_workers as w
from tpcompile.inspect.advise import advise
from tpcompile.inspect.costs import DEVICES, CostModel
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
    return advise(model, inputs, world_size, CostModel(DEVICES["h100"])).configs


def _pick(configs, **want):
    return next(c for c in configs if all(getattr(c, k) == v for k, v in want.items()))


def _estimated(row) -> dict:
    return {"params": row.param_bytes, "grads": row.grad_bytes,
            "optimizer": row.optimizer_bytes, "activations": row.activation_bytes}


def _check(measured: list[dict], estimate: dict, parts=PARTS) -> None:
    for part in parts:
        most = max(m[part] for m in measured)
        print(part, estimate[part], most, estimate[part] / most)
        assert abs(estimate[part] - most) <= TOLERANCE * most, (part, estimate[part], most)


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_estimates_are_within_15_percent_of_the_measured(world_size):
    ranks = run_on_ranks(f"{BODIES}:memory", world_size, timeout=300)
    configs = _estimates(world_size)
    for mode in ("none", "selective", "full"):
        row = _pick(configs, tp=world_size, checkpointing=mode, sp=False)
        _check([r[mode] for r in ranks], _estimated(row))
    none, full = (_pick(configs, tp=world_size, checkpointing=m, sp=False) for m in ("none", "full"))
    assert full.activation_bytes * 2 < none.activation_bytes  # checkpointing is visible
    if world_size == 4:
        row = _pick(configs, tp=2, fsdp=True, checkpointing="none", sp=False)
        _check([r["fsdp"] for r in ranks], _estimated(row), PARTS[:3])
