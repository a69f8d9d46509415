"""Random streams on real gloo ranks: one stream where the math needs one.

A model drawing random numbers on replicated paths (label dropout, noise) and on a sharded one
(dropout of the MLP's hidden activation): ranks seeded the same match the unsharded model
under that seed, outputs and every gradient; ranks seeded differently raise
``RandomStateError`` on every rank (never replicas that match no rank's unsharded result); a
model that draws nothing runs exact whatever the seeds. At 2 ranks (1-D) and on a 2 x 2 mesh
whose data-parallel replicas are seeded differently (allowed) and whose tensor-parallel ranks
are seeded differently (refused).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import LaunchedOnDemand, cases
from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

WORKERS = str(Path(__file__).parent / "random_workers.py")
LAYOUTS = {2: 1, 4: 2}  # world size -> data-parallel degree


@pytest.fixture(scope="module")
def results():
    return LaunchedOnDemand(lambda ws: run_on_ranks(f"{WORKERS}:streams", ws, LAYOUTS[ws]))


@pytest.mark.parametrize("ws", LAYOUTS)
def test_ranks_seeded_the_same_match_the_unsharded_model(results, ws):
    for c in cases(results, ws, "same_seed"):
        assert c["sharded"] and "refused" not in c, c
        assert c["output_err"] <= 1e-6 and c["grad_err"] <= 1e-5, c


@pytest.mark.parametrize("ws", LAYOUTS)
def test_tensor_parallel_ranks_seeded_differently_are_refused_on_every_rank(results, ws):
    for c in cases(results, ws, "seeded_per_rank"):
        assert c.get("refused") == "RandomStateError", c
        assert "seed every rank of the group the same" in c["message"]


@pytest.mark.parametrize("ws", LAYOUTS)
def test_a_model_that_draws_nothing_may_be_seeded_per_rank(results, ws):
    for c in cases(results, ws, "no_draws_seeded_per_rank"):
        assert "refused" not in c, c
        assert c["output_err"] <= 1e-6 and c["grad_err"] <= 1e-5, c
