"""explain(...).to_dtensor_plan() applied with PyTorch's parallelize_module on 2 gloo ranks.

The plan must give the unsharded model's outputs and gradients, the same outputs as tpcompile,
and the very shards tpcompile holds, for every module it includes.
"""

from __future__ import annotations

import pytest

from support import launch

pytestmark = pytest.mark.dist

# case -> (modules expected in the plan, modules expected to be left out)
EXPECTED = {  # one layer / block each
    "mlp": ({"blocks.0.fc1", "blocks.0.fc2"}, set()),
    # the built-in Llama hard-codes n_heads in its views: only the SwiGLU MLP maps
    "llama": ({f"layers.0.feed_forward.{m}" for m in ("w1", "w2", "w3")},
              {f"layers.0.attention.{m}" for m in ("wq", "wk", "wv", "wo")}),
    # views written with -1: attention (GQA, 2 kv heads) and MLP both map
    "inferred_heads": ({f"layers.0.{m}" for m in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")}, set()),
}


@pytest.fixture(scope="module")
def results():
    return launch("dtensor_equivalence", 2, list(EXPECTED))


@pytest.mark.parametrize("case", list(EXPECTED))
def test_parallelize_module_with_the_exported_plan_matches_the_model(results, case):
    included, left_out = EXPECTED[case]
    for rank, per_case in enumerate(results):
        r = per_case[case]
        assert "error" not in r, r.get("error")
        assert set(r["plan"]) == included
        assert {s for m, s in r["plan"].items() if m.endswith(("fc2", "wo", "w2"))} == {"RowwiseParallel"}
        assert set(r["not_expressible"]) == left_out
        assert r["output_err"] <= 1e-5, (rank, r["output_err"])
        assert r["vs_tpcompile"] <= 1e-5, (rank, r["vs_tpcompile"])
        worst = max(r["grad_errs"], key=r["grad_errs"].get)
        assert r["grad_errs"][worst] <= 1e-5, (rank, worst, r["grad_errs"][worst])
        # DTensor holds exactly tpcompile's shard of every parameter it shards
        assert r["same_shards"] and all(r["same_shards"].values()), r["same_shards"]
        assert {n.rpartition(".")[0] for n in r["same_shards"]} == included
