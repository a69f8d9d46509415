"""The sweep's representative Hugging Face families, planned in CI (the full sweep runs outside
it: ``python -m bench.hf_sweep --numerics``). Each is built from its own config shrunk to
hidden 64 and 2 layers, captured and planned at 2 ranks with meta-free tiny weights; its plan
must sit at the Megatron bound as the sweep classifies it: every block weight Megatron shards
sharded, parameters per rank at the ideal, no gathers or fallbacks, collectives per layer
within the bound (Megatron's own extra all-reduces for replicated KV / router / q-k-norm
weights counted)."""

from __future__ import annotations

import pytest

from bench import hf_sweep as sweep

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", sweep.REPRESENTATIVE)
def test_family_is_planned_at_the_bound(family):
    row = sweep.measure(family, numerics=False)
    assert row["status"] == "at bound", {k: row.get(k) for k in (
        "status", "per_layer", "megatron_bound", "over_ideal", "gathers", "fallbacks",
        "not_sharded", "kept_replicated")}
