"""TP inside pipeline stages: pp 2 x tp 2 on 4 gloo ranks (body in ``pipeline_workers.py``).

Each stage's module is parallelized over its tp sub-mesh and run by
``torch.distributed.pipelining`` (GPipe, 2 microbatches); each microbatch's loss and every
gradient (gathered over tp) equal the unsharded model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.tools import models
from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

BODIES = str(Path(__file__).parent / "pipeline_workers.py")


def test_pp2_tp2_losses_and_gradients_equal_the_unsharded_model():
    ranks = run_on_ranks(f"{BODIES}:pp_tp", 4, timeout=300)
    assert [r["stage"] for r in ranks] == [0, 0, 1, 1]  # mesh (pp, tp): ranks 0-1 run stage 0
    for r in ranks[2:]:  # the last stage computes the losses
        assert len(r["losses"]) == 2
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (r["losses"], r["ref_losses"])
    names = sorted(ranks[0]["names"] + ranks[2]["names"])
    assert names == sorted(n for n, _ in models.build("llama", dim=32, hidden=64, n_layers=2,
                                                       vocab=64).named_parameters())
    for r in ranks:  # against the largest gradient of the model
        assert max(r["grad_err"].values()) <= 1e-5, r["grad_err"]
