"""Model code in the styles real projects use (tests/idioms.py), planned at Megatron's bound.

For each idiom the planner now handles, at 2 and 4 ranks: every weight takes the style the
corpus expects, the largest rank holds no more than the ideal bytes (sharded weights / N +
the rest whole), every layer issues exactly the corpus's all-reduces and nothing else, and on
real gloo ranks the output and every gradient equal the unsharded model's. ``bench/idioms.py``
measures the whole corpus (idioms still off the bound included) and writes
bench/results/idioms.md.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "idioms.py"
sys.path.insert(0, str(BENCH.parent))  # the bench scripts import each other by name
_spec = importlib.util.spec_from_file_location("tpcompile_bench_idioms", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

AT_BOUND = [
    "rope_rotate_half",        # the baseline the planner was built against
    "rope_gptj_interleaved",   # x[..., 0::2] and stack(..., -1).flatten(-2)
    "rope_pair_stack",         # reshape(..., -1, 2) + stack + flatten(3)
    "einsum_qkv_3d",           # einsum("bld,dhk->blhk") on 3-D Parameters
    "swiglu_raw_params",       # x @ w and einsum("btd,dh->bth") on raw Parameters
    "swiglu_fused_gate_up",    # one gate_up Linear chunked in two (crashed a pass before)
    "linear_subclass_matmul",  # x @ self.weight.T in a Linear subclass
    "moe_stacked_bmm",         # stacked (experts, out, in) weights through bmm
]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", AT_BOUND)
def test_plan_is_megatrons(name, world_size):
    row = bench.measure(name, world_size)
    assert row["status"] == "ok", row["status"]
    assert not row["not_as_expected"], row["not_as_expected"]
    assert row["param_bytes_max_rank"] <= row["param_bytes_ideal"] * 1.005, row
    assert row["at_megatron_bound"], (row["per_layer"], row["outside_layers"], row["gathers"])
    assert not row["fallbacks"], row["fallbacks"]


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_outputs_and_every_gradient_equal_the_unsharded_model(world_size):
    verdicts = bench.numerics(AT_BOUND, world_size)
    for name in AT_BOUND:
        text = verdicts[name]
        assert text[0].isdigit() and "MISMATCH" not in text, f"{name}: {text}"
