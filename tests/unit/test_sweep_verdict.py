"""The sweeps' status says what ``explain``'s verdict says: a weight the derived bound splits
and the plan keeps whole takes a plan off the bound wherever it sits, in a repeated block or in
the code around the blocks (bench/hf_verdict.py; the sweeps once judged the blocks' weights
only, and called AnyFlow at the bound where explain named two weights kept whole)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")


def test_a_weight_around_the_blocks_kept_whole_is_off_the_bound():
    from bench.diffusers_sweep import measure

    row = measure("AnyFlowTransformer3DModel", numerics=False)
    assert row["per_layer"] == row["megatron_bound"], row  # the blocks' counts are the bound's
    assert row["status"] == "off bound", row
    assert sorted(k.split(":")[0] for k in row["not_sharded"]) == [
        "model.condition_embedder.time_proj.weight", "model.proj_out.weight"]
