"""Flex attention on real gloo ranks (bodies in ``flex_workers.py``, models in zoo/flex_models.py).

Each block's ``score_mod`` biases head ``h`` by ALiBi's ``slope(h)``, so a rank that saw its
local head index would bias its heads like rank 0's (a 5% output error at 2 ranks, measured by
disabling the shift). At 2 and 4 ranks, with the block mask a call input (a ``BlockMask``) or
built in ``forward``, the slopes computed from ``h`` or read from a table by ``h``, 8 query
heads over 8, 4 or 2 kv heads: q / k / v cut by heads (k / v whole where fewer kv heads than
ranks), one all-reduce forward and one backward, and the output and every gradient equal the
same block written with explicit scores and softmax (the reference CPU can differentiate: the
captured graph calls the higher-order op, whose dense backward runs on CPU). A call with a
block mask of another ``mask_mod`` is refused by name, not run with the captured one.

A tiny Hugging Face Llama loaded with ``attn_implementation="flex_attention"`` (8 query heads,
2 kv heads, 2 layers; captured at the example's sizes) is planned as under SDPA: every block
matrix cut (k / v whole at 4 ranks), 2 all-reduces per layer each way, and its output and
every gradient equal the same weights run with ``"sdpa"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import LaunchedOnDemand
from tpcompile.tools.launch import run_on_ranks
from zoo import flex_models

pytestmark = pytest.mark.dist

BODIES = str(Path(__file__).parent / "flex_workers.py")
TOLERANCE = 1e-5
WHOLE_KV = {("flex_alibi_mqa", 4)}  # 2 kv heads over 4 ranks: each rank reads whole kv heads
# 4 ranks with -m slow (CI time): the 2-rank cases already read the global head index on a
# rank that is not rank 0
CASES = [(name, ws) if ws == 2 else pytest.param(name, ws, marks=pytest.mark.slow)
         for name in flex_models.CASES for ws in (2, 4)]

HF = "hf_llama_flex"
_runs = LaunchedOnDemand(lambda ws: run_on_ranks(
    f"{BODIES}:flex_cases", ws, [*flex_models.CASES, HF], timeout=900))


@pytest.mark.parametrize("name,world_size", CASES)
def test_flex_attention_sharded_and_exact(name, world_size):
    for result in (r[name] for r in _runs[world_size]):
        assert "error" not in result, result["error"]
        assert result["output_err"] <= TOLERANCE, result
        assert len(result["grad_errs"]) == 5, result  # norm, q, k, v, o weights
        assert max(result["grad_errs"].values()) <= TOLERANCE, result
        expected = {"q.weight", "o.weight"} | (
            set() if (name, world_size) in WHOLE_KV else {"k.weight", "v.weight"})
        assert set(result["sharded"]) == expected, result["sharded"]
        assert result["collectives"] == {"forward": {"all_reduce": 1},
                                         "backward": {"all_reduce": 1}}, result["collectives"]


@pytest.mark.parametrize("name", [n for n in flex_models.CASES
                                  if not flex_models.CASES[n].get("inner_mask")])
def test_another_mask_mod_is_refused(name):
    for result in (r[name] for r in _runs[2]):
        assert result["other_mask"].startswith("InputError: the call's inputs do not have the "
                                               "example call's structure"), result["other_mask"]


@pytest.mark.parametrize("world_size", (2, pytest.param(4, marks=pytest.mark.slow)))
def test_hugging_face_flex_attention_planned_as_with_sdpa(world_size):
    pytest.importorskip("transformers")
    matrices = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj"] + (["self_attn.k_proj", "self_attn.v_proj"] if world_size == 2
                                    else [])  # 2 kv heads over 4 ranks: read whole
    expected = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in matrices}
    reference = flex_models.build(HF, math_impl=True)[0]
    for result in (r[HF] for r in _runs[world_size]):
        assert "error" not in result, result["error"]
        assert result["output_err"] <= TOLERANCE, result
        assert len(result["grad_errs"]) == len(list(reference.parameters())), result
        assert max(result["grad_errs"].values()) <= TOLERANCE, result
        assert set(result["sharded"]) == expected, result["sharded"]
        assert result["collectives"] == {"forward": {"all_reduce": 4},
                                         "backward": {"all_reduce": 4}}, result["collectives"]


VARLEN_KV = (8, 4, 2)  # query heads 8 over 8, 4, 2 kv heads
_varlen = LaunchedOnDemand(lambda ws: run_on_ranks(f"{BODIES}:varlen_cases", ws, list(VARLEN_KV)))


@pytest.mark.parametrize("world_size", (2, 4))
def test_varlen_attention_cut_by_heads_and_exact(world_size):
    """``torch.nn.attention.varlen.varlen_attn`` on three packed sequences (causal), with a math
    kernel for CPU registered (torch has only CUDA's): q / k / v cut by heads (k / v whole
    where fewer kv heads than ranks), one all-reduce, the unsharded output. Forward only:
    torch's varlen backward runs only on CUDA."""
    for kv in VARLEN_KV:
        for result in (r[kv] for r in _varlen[world_size]):
            assert "error" not in result, result["error"]
            assert result["output_err"] <= TOLERANCE, result
            whole_kv = kv < world_size
            assert result["sharded"] == (["o.weight", "q.weight"] if whole_kv else
                                         ["k.weight", "o.weight", "q.weight", "v.weight"]), result
            assert result["collectives"]["forward"] == {"all_reduce": 1}, result
