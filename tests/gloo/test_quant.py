"""Weight-only quantized Llamas on real gloo ranks (bodies in ``quant_workers.py``).

gpt-fast's int8 linears, group-wise int4 ones and torchao's ``Int8WeightOnlyConfig`` (where
torchao is installed) on every block linear of the built-in Llama (4 kv heads): under ``torch.no_grad`` the sharded model's logits equal the unsharded quantized
model's to 1e-6 relative (float32; row-parallel matmuls sum their partial products in another
order, so not bit for bit), the forward pays Megatron's 2 all-reduces per layer, each rank
stores 1/N of the integer weights (column-parallel: rows; row-parallel: whole groups of the
input dim), and the gathered state equals the model's. gpt-fast's static-cache decoder with
int8 or int4 linears generates the unsharded model's greedy tokens. The plans themselves:
``tests/unit/test_quant_plans.py``.

torchao 0.18's inference configs on a tiny Hugging Face Llama (``zoo/quant_models.TORCHAO``),
parallelized under ``torch.no_grad`` in one launch: the weight-only ones (int8, int4 in groups
of 32, float8) store 1/N of every part (data, scales, zero points) but a row-parallel weight's
per-output-row scales, pay the float model's forward collectives, match the unsharded
quantized model to 1e-6 and ``generate`` its greedy tokens. The dynamic-activation ones
(int8 or int4 weights with int8 activations) are cut alike: a row-parallel matmul's input row
is quantized with the scale of the whole row, its max (and min) all-reduced by max, so the
outputs match to 1e-6 and ``generate`` gives the same tokens; a call with grad enabled is
refused (a straight-through rounding Function was traced through).
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


# 4 ranks with -m slow (CI time): the 2-rank launch checks the same cuts
WORLD_SIZES = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_quantized_outputs_match_the_unsharded_model(results, ws, kind):
    for c in _cases(results, ws, kind):
        assert c["output_err"] <= 1e-6
        assert c["state_mismatches"] == []


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("ws", WORLD_SIZES)
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


WEIGHT_ONLY = ["int8_weight_only", "intx_weight_only", "float8_weight_only"]
DYNAMIC = ["int8_dynamic_int8", "int8_dynamic_intx"]


@pytest.fixture(scope="module")
def torchao():
    """(world size, configs, configs that generate) -> one launch's per-rank results; int4
    groups of 32 at 2 ranks, of 16 at 4 (a rank's 16 input features of o_proj, one group)."""
    pytest.importorskip("torchao")
    return LaunchedOnDemand(lambda key: run_on_ranks(
        f"{BODIES}:torchao", key[0], list(key[1]), 32 if key[0] == 2 else 16, list(key[2]),
        timeout=600))


# CI: one 2-rank launch, every config planned and run, int8 weight-only generating (each
# generate captures twice more; it was the config whose generate failed); slow: the others'
# generate at 2 ranks, and 4 ranks
CI = (2, tuple(WEIGHT_ONLY + DYNAMIC), ("int8_weight_only",))
SLOW = {2: (2, tuple(WEIGHT_ONLY[1:] + DYNAMIC), tuple(WEIGHT_ONLY[1:] + DYNAMIC)),
        4: (4, tuple(WEIGHT_ONLY + DYNAMIC), tuple(WEIGHT_ONLY + DYNAMIC))}


def _torchao_cases(torchao, key: tuple, name: str) -> list:
    per_rank = [r[name] for r in torchao[key]]
    for c in per_rank:
        assert "error" not in c, c.get("error")
    return per_rank


def _whole_as_in_float(name: str, ws: int) -> bool:
    """Parts the float model's plan keeps whole too: a row-parallel weight's scales (one per
    output row, each read by every rank's part) and, with fewer kv heads (2) than ranks, the
    k and v projections."""
    row_scale = name.endswith("_scale") and ("o_proj" in name or "down_proj" in name)
    return row_scale or (ws > 2 and any(p in name for p in ("k_proj", "v_proj")))


def _check_weight_only(cases: list, ws: int, generated: bool = True) -> None:
    for c in cases:
        assert c["output_err"] <= 1e-6
        assert c["tokens"] == c["want"] and (c["tokens"] is not None) == generated
        assert c["collectives"] == {"all_reduce": 2 * N_LAYERS}  # the float model's: unit tests
        whole = [n for n, (style, _) in c["plans"].items() if style == "replicate"]
        assert all(_whole_as_in_float(n, ws) for n in whole), whole
        # k / v whole at 4 ranks: 1/3 of the quantized bytes more than 1/N
        assert 0 < c["part_bytes"] <= (1.1 if ws == 2 else 1.5) * c["part_bytes_total"] / ws
        assert c["training"] == "" and c["inference_only"] == ""


# per layer: the 2 row-parallel sums and, before each, its input row's extremum all-reduced by
# max (int8: max |x|, one) or by min and by max (intx: an asymmetric scale, two)
DYNAMIC_FORWARD = {"int8_dynamic_int8": 2 * (1 + 1), "int8_dynamic_intx": 2 * (1 + 2)}


# Per-token quantization rounds: a float sum upstream (a row-parallel all-reduce) that adds the
# ranks' partials in another order than one matmul moves an activation by an ulp, and once in
# a while across a rounding boundary, one quantization step (1/127 of its row's largest
# magnitude) for that element. Measured: 3.5e-7 at 2 ranks, 7.3e-3 at 4 (int8); the cut itself
# is exact (the scale is a max: bit for bit), so tokens must be the model's.
DYNAMIC_TOL = 1e-2


def _check_dynamic(cases: list, name: str, ws: int) -> None:
    for c in cases:
        assert c["output_err"] <= DYNAMIC_TOL
        assert c["tokens"] == c["want"]
        assert c["collectives"] == {"all_reduce": DYNAMIC_FORWARD[name] * N_LAYERS}
        whole = [n for n, (style, _) in c["plans"].items() if style == "replicate"]
        assert all(_whole_as_in_float(n, ws) for n in whole), whole
        assert 0 < c["part_bytes"] <= (1.1 if ws == 2 else 1.5) * c["part_bytes_total"] / ws
        assert c["inference_only"].startswith("inference only: the forward applies custom "
                                              "autograd Functions (_Round")
        assert c["training"].startswith("CaptureError: this module is inference only")


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_torchao_weight_only_is_cut_like_float_and_generates_the_models_tokens(torchao, name):
    _check_weight_only(_torchao_cases(torchao, CI, name), 2, name in CI[2])


@pytest.mark.slow
@pytest.mark.parametrize("name", WEIGHT_ONLY[1:])
def test_torchao_weight_only_generates_the_models_tokens(torchao, name):
    _check_weight_only(_torchao_cases(torchao, SLOW[2], name), 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_torchao_weight_only_at_four_ranks(torchao, name):
    _check_weight_only(_torchao_cases(torchao, SLOW[4], name), 4)


@pytest.mark.parametrize("name", DYNAMIC)
def test_torchao_dynamic_activations_are_cut_exact_and_refuse_training(torchao, name):
    _check_dynamic(_torchao_cases(torchao, CI, name), name, 2)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", DYNAMIC)
def test_torchao_dynamic_activations_generate_the_models_tokens(torchao, name, ws):
    cases = _torchao_cases(torchao, SLOW[ws], name)
    _check_dynamic(cases, name, ws)
    assert all(c["tokens"] is not None for c in cases)
