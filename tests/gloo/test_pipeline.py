"""TP inside pipeline stages: pp 2 x tp 2 on 4 gloo ranks (body in ``pipeline_workers.py``).

Each stage's module is parallelized over its tp sub-mesh and run by
``torch.distributed.pipelining`` (GPipe, 2 microbatches); each microbatch's loss and every
gradient (gathered over tp, and over dp with FSDP2) equal the unsharded model's. The 8-rank
pp 2 x dp 2 x tp 2 case is marked slow (``pytest -m slow``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.tools import models
from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

BODIES = str(Path(__file__).parent / "pipeline_workers.py")


def _check(ranks: list, stages: list[int]) -> None:
    assert [r["stage"] for r in ranks] == stages
    for r in ranks:
        if r["stage"] == 0:
            continue  # the last stage computes the losses
        assert len(r["losses"]) == 2
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (r["losses"], r["ref_losses"])
    names = sorted(ranks[0]["names"] + ranks[-1]["names"])
    assert names == sorted(n for n, _ in models.build("llama", dim=32, hidden=64, n_layers=2,
                                                       vocab=64).named_parameters())
    for r in ranks:  # against the largest gradient of the model
        assert max(r["grad_err"].values()) <= 1e-5, r["grad_err"]


def test_pp2_tp2_losses_and_gradients_equal_the_unsharded_model():
    _check(run_on_ranks(f"{BODIES}:pp_tp", 4, timeout=300), [0, 0, 1, 1])  # mesh (pp, tp)


@pytest.mark.slow
def test_pp2_dp2_tp2_with_fsdp2_inside_stages_at_8_ranks():
    """FSDP2 (root of each stage) over dp inside each stage; 8 ranks, ~2 min on 2 cores."""
    _check(run_on_ranks(f"{BODIES}:pp_tp", 8, 2, timeout=600), [0] * 4 + [1] * 4)
