"""Weight-only quantized Llamas on real gloo ranks (bodies in ``quant_workers.py``).

gpt-fast's int8 linears, group-wise int4 ones and torchao's ``Int8WeightOnlyConfig`` (where
torchao is installed) on every block linear of the built-in Llama (4 kv heads): under ``torch.no_grad`` the sharded model's logits equal the unsharded quantized
model's to 1e-6 relative (float32; row-parallel matmuls sum their partial products in another
order, so not bit for bit), the forward pays Megatron's 2 all-reduces per layer, each rank
stores 1/N of the integer weights (column-parallel: rows; row-parallel: whole groups of the
input dim), and the gathered state equals the model's. gpt-fast's static-cache decoder with
int8 or int4 linears generates the unsharded model's greedy tokens. The plans themselves:
``tests/unit/test_quant_plans.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from support import LaunchedOnDemand
from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

BODIES = str(Path(__file__).parent / "quant_workers.py")
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
KINDS = ["int8", "int4"] + (["torchao_int8"] if HAS_TORCHAO else [])
N_LAYERS = 2
ROWWISE = (".wo.", ".w2.")


@pytest.fixture(scope="module")
def results():
    """world size -> one launch's per-rank results."""
    return LaunchedOnDemand(lambda ws: run_on_ranks(f"{BODIES}:quant", ws, KINDS, timeout=600))


def _cases(results, ws: int, kind: str) -> list:
    per_rank = [r[kind] for r in results[ws]]
    for c in per_rank:
        assert "error" not in c, c.get("error")
    return per_rank


def _kinds() -> list:
    no_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
    return ["int8", "int4", pytest.param("torchao_int8", marks=no_torchao)]


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("ws", [2, 4])
def test_quantized_outputs_match_the_unsharded_model(results, ws, kind):
    for c in _cases(results, ws, kind):
        assert c["output_err"] <= 1e-6
        assert c["state_mismatches"] == []


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("ws", [2, 4])
def test_quantized_forward_at_megatrons_bound_with_one_nth_of_the_weights(results, ws, kind):
    for c in _cases(results, ws, kind):
        assert c["collectives"] == {"all_reduce": 2 * N_LAYERS}
        assert 0 < c["int_bytes"] <= 1.02 * c["int_bytes_total"] / ws
        for name, style in c["styles"].items():
            assert style == ("rowwise" if any(m in name for m in ROWWISE) else "colwise"), name


@pytest.fixture(scope="module")
def generated():
    return LaunchedOnDemand(lambda ws: run_on_ranks(f"{BODIES}:generation", ws, ["int8", "int4"],
                                                    timeout=600))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_static_cache_decoder_generates_the_unsharded_tokens(generated, kind):
    for c in generated[2]:
        c = c[kind]
        assert "error" not in c, c.get("error")
        assert c["tokens"] == c["want"]
        assert 0 < c["int_bytes"] <= 1.02 * c["int_bytes_total"] / 2
