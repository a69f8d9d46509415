"""No hangs at parallelize: ranks that plan differently or fail to plan end in a clear error.

One 2-rank spawn (tests/gloo/reliability_workers.py:failures) runs every scenario in turn. What
happens when a rank misbehaves later, at call time (another shape, a skipped forward or
backward, a rank that exits), is the chaos matrix of tests/gloo/test_chaos.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

WORKERS = str(Path(__file__).parent / "reliability_workers.py")


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(f"{WORKERS}:failures", 2, timeout=600)


def test_other_model_names_the_first_differing_entry_on_every_rank(ranks):
    messages = [r["other_hidden"] for r in ranks]
    assert messages[0] == messages[1]  # every rank raises the same error
    m = messages[0]
    assert m.startswith("PlanMismatchError: ranks planned differently; the first entry that differs")
    assert "rank 0: captured node blocks_0_fc1_weight:" in m and "float32[128, 64]" in m
    assert "rank 1: captured node blocks_0_fc1_weight:" in m and "float32[96, 64]" in m


def test_other_options_are_named(ranks):
    m = ranks[0]["other_options"]
    assert m == ranks[1]["other_options"]
    assert 'rank 0: plan options vocab_parallel: false' in m
    assert 'rank 1: plan options vocab_parallel: true' in m


def test_a_rank_that_cannot_plan_stops_the_others(ranks):
    assert ranks[1]["one_rank_fails"].startswith(
        "CaptureError: StraightThrough is a custom torch.autograd.Function")
    assert ranks[0]["one_rank_fails"].startswith(
        "PlanMismatchError: rank 1 could not parallelize the model (CaptureError: StraightThrough")


def test_rewritten_collectives_are_compared_too(ranks):
    m = ranks[0]["other_collectives"]
    assert m == ranks[1]["other_collectives"]
    assert "rank 0: collective 1: all_reduce = all_reduce" in m  # collective 0: f (copy_into_chain)
    assert "rank 1: collective 1: all_reduce = copy_into_chain" in m


def test_ranks_with_other_weights_are_warned_about(ranks):
    for r in ranks:
        (m,) = r["other_weights_warning"]
        assert m.startswith("tpcompile: ranks hold different weights; the first that differs is "
                            "entry 0:\n  rank 0: values of fc1.weight: sum ")
        assert "\n  rank 1: values of fc1.weight: sum " in m
        assert "seed every rank alike, or load a checkpoint after parallelize" in m


def test_a_very_long_process_group_timeout_is_warned_about(ranks):
    for r in ranks:
        assert len(r["long_timeout_warning"]) == 1
        assert "the process group's timeout is 2:00:00" in r["long_timeout_warning"][0]
