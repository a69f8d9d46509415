"""torchtitan 0.3's language models (flex attention only), when that release is installed.

The ``debugmodel`` flavours of its llama3 and qwen3 registries (fused ``wqkv`` viewed as (kv
heads, q per kv + 2, head_dim) and split; a document BlockMask from ``get_attention_masks``
passed as ``attention_masks``), at 2 and 4 ranks: planned at Megatron's bound derived from the
model with nothing gathered, and on gloo ranks the output equal to the unsharded model's and
every gradient to the unsharded captured graph's (torch refuses the model's own flex attention
backward on CPU; the captured higher-order op's dense backward runs). The bench extra pins
torchtitan 0.2.2 (bench/upstream.py's rows); 0.3 installs beside torch 2.13 without another
torch, as CI installs it: ``pip install --no-deps -r .ci/torchtitan-0.3.txt``.

DeepSeek-V3's debug model (MLA, a dense first layer, then MoE layers of 8 grouped experts and a
shared expert; ``deepseek_v3``) runs its routed experts in bfloat16: ``GroupedExperts`` casts
the tokens and each weight (``w1_EFD.bfloat16()``) before ``_grouped_mm``. The cut starts at the
stored weight through the cast, so the experts are column -> row like the shared expert. Each
grouped matmul rounds its output to bfloat16 once, the sharded model each rank's partial sum:
the two differ by a few bfloat16 units (u = 2**-8 relative), in the output and in every
gradient that flows through the experts. The tolerance is 4u. Its ``wkv_a`` (MLA's kv down
projection, 256 -> 576, wider than the model) is kept whole, as Megatron-LM and torchtitan's
own plan keep it, and so does the bound: its latent is normalized whole and expanded 8x into
heads by ``wkv_b``. Its rotary table is sliced by a size read off the q projection in the
first block; the rope piece's gradient sync still shares q's input's all-reduce.

gpt-oss's debug model (varlen attention with sinks, biased experts through custom autograd
Functions) trains only through those Functions, which torch.export does not keep: training is
refused by name, and under ``no_grad`` it is planned at the bound (attention, sinks and experts
cut by heads and features). Its numerics are not compared here: in float32 torchtitan 0.3's
own forward fails on CPU (its combine scatters bfloat16 expert rows into a float32 sum), and in
bfloat16 a router's top-k flips between a sharded and an unsharded sum of the same tokens
(0.1 relative output difference at 2 ranks), so outputs are not comparable. Varlen attention's
numerics are tested on a block of its own (test_flex_attention, a math CPU kernel).

llama3 is also trained as torchtitan trains it, on a 2-D mesh with FSDP2 over the data-parallel
dim (``test_trained_as_torchtitan_trains_it_with_fsdp2_on_a_2d_mesh``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from support import LaunchedOnDemand
from tpcompile.tools.launch import run_on_ranks
from zoo import flex_models

try:
    TITAN = version("torchtitan")
except PackageNotFoundError:
    TITAN = ""
pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    not TITAN.startswith("0.3"), reason=f"needs torchtitan 0.3 (installed: {TITAN or 'none'})")]

BODIES = str(Path(__file__).parent / "flex_workers.py")
KINDS = ["llama3", "qwen3", "deepseek_v3"]
TOLERANCE = {"llama3": 1e-5, "qwen3": 1e-5, "deepseek_v3": 4 * 2.0 ** -8}
WHOLE = {"deepseek_v3": "attention.wkv_a.weight"}  # MLA's down projection, whole by the bound
# the bound's all-reduces, carrying more bytes: DeepSeek-V3's routed experts' partial sums are
# all-reduced per (token, expert) row before the routing scores scale them and the rows are
# summed per token, 3x the token rows at top-3 (bench/results/bound-bytes-2026-12-07.md)
MORE_BYTES = {"deepseek_v3"}
# (world size, kinds) -> one launch: CI's is llama3 and qwen3 at 2 ranks; deepseek_v3 (its
# experts' bfloat16 grouped matmuls: most of a launch's time) and 4 ranks with -m slow
_runs = LaunchedOnDemand(lambda key: run_on_ranks(f"{BODIES}:titan_cases", key[0], list(key[1]),
                                                 timeout=1800))


@pytest.mark.parametrize("kind,world_size", [(k, ws) for k in KINDS for ws in (2, 4)])
def test_planned_at_the_bound(kind, world_size):
    import tpcompile
    from tpcompile.inspect.traffic import bound_verdict

    model, inputs, kwargs = flex_models.torchtitan(kind)
    report = tpcompile.explain(model, inputs, world_size, example_kwargs=kwargs)
    assert not report.fallbacks, report.fallbacks
    verdict = bound_verdict(report.megatron)
    if kind in MORE_BYTES:
        assert verdict.startswith("above the bound: +") and "collectives" not in verdict, verdict
    else:
        assert verdict.startswith("at the bound"), str(report)[-3000:]
    whole = {n for n, p in report.params.items() if p.style == "replicate"}
    assert {n for n in whole if n.endswith(WHOLE.get(kind, "-"))} == {
        n for n in report.params if n.endswith(WHOLE.get(kind, "-"))}


# CI plans every kind at 2 and 4 ranks above and runs llama3 on 4 in the FSDP2 test below
IN_CI = ("llama3", "qwen3")


@pytest.mark.parametrize("kind,world_size", [
    pytest.param(k, ws, marks=[] if ws == 2 and k in IN_CI else [pytest.mark.slow])
    for k in KINDS for ws in (2, 4)])
def test_forward_and_every_gradient_exact(kind, world_size):
    model = flex_models.torchtitan(kind)[0]
    # every block matrix (stacked experts too) but the MoE router's gate (a router stays whole:
    # its output picks experts by topk) and MLA's down projection
    whole = WHOLE.get(kind, "-")
    blocks = sum(p.dim() >= 2 and ".router." not in n and not n.endswith(whole)
                 for n, p in model.named_parameters() if n.startswith("layers."))
    launch = (world_size, IN_CI if world_size == 2 and kind in IN_CI else tuple(KINDS))
    for result in (r[kind] for r in _runs[launch]):
        assert "error" not in result, result["error"]
        assert result["output_err"] <= TOLERANCE[kind], result
        assert len(result["grad_errs"]) == sum(p.requires_grad for p in model.parameters())
        assert max(result["grad_errs"].values()) <= TOLERANCE[kind], result
        assert result["sharded"] == blocks, result


@pytest.mark.parametrize("world_size", (2, 4))
def test_inference_only_models_are_refused_for_training_and_planned_at_the_bound(world_size):
    import torch
    import tpcompile

    model, inputs, kwargs = flex_models.torchtitan("gpt_oss")
    with pytest.raises(tpcompile.CaptureError, match="custom torch.autograd.Function"):
        tpcompile.explain(model, inputs, world_size, example_kwargs=kwargs)
    with torch.no_grad():
        report = tpcompile.explain(model, inputs, world_size, example_kwargs=kwargs)
    assert not report.fallbacks, report.fallbacks
    assert "-> at the bound" in str(report), str(report)[-3000:]
    cut = {n for n, p in report.params.items() if p.style != "replicate"}
    assert {"layers.0.attention.qkv_linear.wqkv.weight", "layers.0.attention.sinks",
            "layers.0.attention.wo.weight",
            "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"} <= cut, cut


def test_trained_as_torchtitan_trains_it_with_fsdp2_on_a_2d_mesh():
    """llama3 on a (dp 2, tp 2) mesh of 4 gloo ranks: parallelized over tp, FSDP2 over dp on
    each block and the root (``fully_shard_blocks``, torchtitan's order), each dp rank on its
    half of the batch, 3 AdamW steps: every step's global loss is the unsharded captured
    graph's on the whole batch. torchtitan's own trainer and hand TP plan are not the
    reference: they run the model's flex attention, whose backward torch refuses on CPU."""
    (result,) = {repr(r): r for r in run_on_ranks(f"{BODIES}:titan_fsdp_tp", 4, "llama3", 3,
                                                   timeout=1800)}.values()
    for got, want in result["losses"]:
        assert abs(got - want) <= 1e-5 * abs(want), result["losses"]
