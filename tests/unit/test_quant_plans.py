"""Weight-only quantized Llamas, planned without a process group (``tpcompile.explain``).

gpt-fast's int8 linears and group-wise int4 ones (``zoo/quant_models.py``) are planned like
the float model they came from: every block linear column- or row-parallel as Megatron cuts
it, the forward paying 2 all-reduces per layer, and each rank storing 1/N of every integer
weight and of the int4 scales and zeros (column-parallel: its rows; row-parallel: whole
groups of the input dim). torchao 0.18's weight-only configs (int8, int4 in groups, float8)
on a tiny Hugging Face Llama are planned like its float model; its dynamic-activation configs
are inference only and cut alike, each row-parallel matmul's input row scaled after one
all-reduce by max (two, min and max, for an asymmetric scale), at the bound derived from the
model. Numerics on gloo ranks: ``tests/gloo/test_quant.py``.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tpcompile import CaptureError
from tpcompile.api import plan_model
from tpcompile.inspect.explain.explain import explain
from tpcompile.tools import models
from zoo import quant_models

N_LAYERS = 2
ROWWISE = ("wo", "w2")


def _report(model, inputs, ws):
    return explain(model, inputs, world_size=ws, dynamic=False)


def _forward(report) -> collections.Counter:
    return collections.Counter(c.op for c in report.collectives if c.phase == "forward")


def _verdict(report) -> str:
    return next(line for line in str(report).splitlines() if line.strip().startswith("-> "))


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("ws", [2, 4])
def test_quantized_llama_is_planned_like_the_float_one(kind, ws):
    model, inputs = quant_models.build(kind)
    plain = _report(models.build("llama", n_kv_heads=4).requires_grad_(False), inputs, ws)
    report = _report(model, inputs, ws)
    assert _forward(report) == _forward(plain) == {"all_reduce": 2 * N_LAYERS}
    for name in quant_models.quantized_names(model):
        p = report.params[name]
        linear = name.rpartition(".")[0].rpartition(".")[2]
        assert p.style == ("rowwise" if linear in ROWWISE else "colwise"), name
        assert p.style == plain.params[name].style, name
        assert math.prod(p.local_shape) * ws == math.prod(p.global_shape), name
    assert _verdict(report) == _verdict(plain)  # frozen: the backward half of the bound is unpaid


@pytest.mark.parametrize("ws", [2, 4])
def test_int4_scales_follow_their_weight_and_groups_stay_whole(ws):
    """A column-parallel weight's scales and zeros are cut by output rows (dim 1), a
    row-parallel one's by groups of the input dim (dim 0): each rank holds whole groups."""
    model, inputs = quant_models.build("int4")
    report = _report(model, inputs, ws)
    for name in quant_models.quantized_names(model):
        owner = name.rpartition(".")[0]
        w, sz = report.params[name], report.params[f"{owner}.scales_and_zeros"]
        assert sz.style == w.style, owner
        if w.style == "colwise":
            assert (w.dim, sz.dim) == (0, 1) and sz.local_shape[1] == w.local_shape[0], owner
        else:  # packed two per byte: a rank's input columns are 2 * its packed ones
            assert (w.dim, sz.dim) == (1, 0), owner
            assert sz.local_shape[0] * quant_models.GROUP == 2 * w.local_shape[1], owner


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("ws", [2, 4])
def test_integer_bytes_per_rank_are_one_nth(kind, ws):
    """Every integer weight is counted in the report's bytes and held 1/N per rank."""
    model, inputs = quant_models.build(kind)
    report = _report(model, inputs, ws)
    state = model.state_dict()
    names = quant_models.quantized_names(model)
    total = sum(state[n].numel() * state[n].element_size() for n in names)
    local = sum(math.prod(report.params[n].local_shape) * state[n].element_size() for n in names)
    assert local <= 1.02 * total / ws
    assert report.param_bytes_total >= total + sum(p.numel() * p.element_size()
                                                   for p in model.parameters())


def test_groups_wider_than_a_ranks_share_keep_the_weight_whole_and_say_so():
    """Groups of 64 input features over 4 ranks: w2's 128 inputs are 2 groups, and a rank's
    32 would cut one, so w2 and its scales stay whole (sliced at their use) and explain does
    says the plan is above Megatron's bound, naming them. wo's 64 inputs are one group: each rank holds 16 of its
    columns and the group's scale and zero whole."""
    model, inputs = quant_models.build("int4", group=64)
    report = _report(model, inputs, 4)
    for layer in range(N_LAYERS):
        w2, wo = (f"layers.{layer}.{m}" for m in ("feed_forward.w2", "attention.wo"))
        assert report.params[f"{w2}.weight"].style == "replicate"
        assert "would split a group" in report.params[f"{w2}.weight"].reason
        assert report.params[f"{w2}.scales_and_zeros"].style == "replicate"
        assert report.params[f"{wo}.weight"].local_shape == [64, 8]
        assert report.params[f"{wo}.scales_and_zeros"].style == "replicate"
    text = str(report)
    assert "at the bound" not in text and "-> above the bound: " in text
    whole = [w for m in report.megatron for w in m.whole]
    assert sorted(whole) == sorted(f"layers.{i}.feed_forward.w2.weight" for i in range(N_LAYERS))


@pytest.mark.parametrize("ws", [2, 4])
def test_torchao_int8_is_planned_like_gpt_fasts(ws):
    """torchao's ``Int8Tensor`` weight is stored as its parts (``weight_qdata``,
    ``weight_scale``): the int8 part is cut as gpt-fast's int8 weight is."""
    pytest.importorskip("torchao")
    model, inputs = quant_models.build("torchao_int8")
    gpt_fast, _ = quant_models.build("int8")
    report, twin = _report(model, inputs, ws), _report(gpt_fast, inputs, ws)
    assert _forward(report) == _forward(twin) == {"all_reduce": 2 * N_LAYERS}
    for name in quant_models.quantized_names(gpt_fast):
        got, want = report.params[f"{name}_qdata"], twin.params[name]
        assert got.quantized and got.dtype == "int8", name
        assert (got.style, got.local_shape) == (want.style, want.local_shape), name


@pytest.mark.parametrize("kind", ["int4", "torchao_int8"])
def test_reusing_blocks_plans_quantized_weights_alike(kind):
    """``reuse_blocks=True`` stamps the fourth block from three exported ones: the quantized
    weights (torchao's parts too) are cut as a whole capture cuts them."""
    if kind.startswith("torchao"):
        pytest.importorskip("torchao")
    model = models.build("llama", n_kv_heads=4, n_layers=4).eval()
    inputs = models.example_inputs(model)
    model = (quant_models.torchao_int8(model) if kind.startswith("torchao")
             else quant_models.quantized(model, kind))
    whole, reused = (explain(model, inputs, world_size=2, dynamic=False, reuse_blocks=r)
                     for r in (False, True))
    assert _forward(reused) == _forward(whole) == {"all_reduce": 8}
    assert reused.param_bytes_per_rank == whole.param_bytes_per_rank
    for name, p in whole.params.items():
        assert (reused.params[name].style, reused.params[name].local_shape) == (
            p.style, p.local_shape), name


def _torchao_llama(name: str, frozen: bool = True, family: str = "llama"):
    from zoo.hf_models import hf_causal_lm, hf_prompt

    ids, mask = hf_prompt()
    return quant_models.torchao_blocks(hf_causal_lm(family).eval(), name, frozen=frozen), ids


def _float_bytes(model) -> int:
    """Bytes of the model's plain parameters (not its subclass weights)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not is_traceable_wrapper_subclass(p))


def _part_bytes(report, model) -> int:
    """Bytes of every part of the model's subclass weights (data, scales, zero points)."""
    return sum(math.prod(p.global_shape) * torch.empty(0, dtype=getattr(torch, p.dtype))
               .element_size() for n, p in report.params.items()
               if n.rpartition(".")[2].startswith("weight_"))


@pytest.mark.parametrize("name", ["int8_weight_only", "intx_weight_only", "float8_weight_only"])
def test_torchao_weight_only_configs_are_planned_like_the_float_model(name):
    """Every quantized block weight of torchao's weight-only configs (float8 and group-wise
    int4 included) is cut as the float weight is, with its scales and zero points (a
    row-parallel weight's scales, one per output row, whole); the report counts every part."""
    pytest.importorskip("torchao")
    from zoo.hf_models import hf_causal_lm

    model, ids = _torchao_llama(name)
    plain = _report(hf_causal_lm("llama").eval().requires_grad_(False), (ids,), 2)
    with torch.no_grad():
        report = _report(model, (ids,), 2)
    assert _forward(report) == _forward(plain) == {"all_reduce": 2 * N_LAYERS}
    for fqn, want in plain.params.items():
        if not fqn.endswith(".weight") or ".layers." not in fqn or "norm" in fqn:
            continue
        owner = fqn.removesuffix(".weight")
        for part in ("qdata", "scale", "zero_point"):
            got = report.params.get(f"{owner}.weight_{part}")
            if got is None or (part == "scale" and want.style == "rowwise"
                               and got.global_shape[1] == 1):
                continue
            assert (got.style, got.dim) == (want.style, want.dim), (owner, part)
    assert _verdict(report).strip().startswith("-> at the bound")
    assert report.param_bytes_total == _float_bytes(model) + _part_bytes(report, model)


def test_intx_groups_a_rank_would_split_keep_the_weight_whole_and_say_so():
    """Int4 groups of 32 over 4 ranks: a rank's 16 of o_proj's 64 input features would split
    a group, so o_proj stays whole, named, and the plan is above the bound; down_proj's 128
    are 4 groups, one per rank, with its scales and zero points."""
    pytest.importorskip("torchao")
    model, ids = _torchao_llama("intx_weight_only")
    with torch.no_grad():
        report = _report(model, (ids,), 4)
    for layer in range(N_LAYERS):
        o, down = (f"model.layers.{layer}.{m}.weight_" for m in ("self_attn.o_proj", "mlp.down_proj"))
        assert report.params[o + "qdata"].style == "replicate"
        assert "would split a group" in report.params[o + "qdata"].reason
        for part in ("qdata", "scale", "zero_point"):
            p = report.params[down + part]
            assert p.style == "rowwise" and p.dim == 1, (down, part)
        assert report.params[down + "scale"].local_shape == [64, 1]
    assert _verdict(report).strip().startswith("-> above the bound: ")


# a row-parallel matmul's activations, quantized per token over their cut row: their extremum
# all-reduced (int8 symmetric: max |x|, one; intx asymmetric: min and max, two) + its sum
DYNAMIC_FORWARD = {"int8_dynamic_int8": 2 * (1 + 1), "int8_dynamic_intx": 2 * (2 + 1)}


@pytest.mark.parametrize("name", ["int8_dynamic_int8", "int8_dynamic_intx"])
def test_dynamic_activation_configs_are_inference_only_and_cut_like_the_float_model(name):
    """torchao's dynamic activation quantization rounds through a straight-through autograd
    Function: refused for training, planned under no_grad (or frozen) with every quantized
    weight cut as the float one (a row-parallel weight's per-row scales whole, named), the
    scale of a cut row all-reduced by max / min, at the bound, every part judged and counted."""
    pytest.importorskip("torchao")
    from zoo.hf_models import hf_causal_lm

    trainable, ids = _torchao_llama(name, frozen=False)
    with pytest.raises(CaptureError, match="_Round is a custom torch.autograd.Function"):
        _report(trainable, (ids,), 2)
    with torch.no_grad():
        report = _report(trainable, (ids,), 2)
    _, plan = plan_model(trainable.requires_grad_(False), (ids,), 2)  # frozen: grad mode aside
    assert plan.inference_only.startswith("inference only: the forward applies custom autograd")
    plain = _report(hf_causal_lm("llama").eval().requires_grad_(False), (ids,), 2)
    for fqn, want in plain.params.items():
        if not fqn.endswith(".weight") or ".layers." not in fqn or "norm" in fqn:
            continue
        got = report.params[fqn.removesuffix(".weight") + ".weight_qdata"]
        assert (got.style, got.dim) == (want.style, want.dim), fqn
    whole = {n: p.reason for n, p in report.params.items()
             if n.rpartition(".")[2].startswith("weight_") and p.style == "replicate"}
    assert all(n.endswith("_scale") and ("o_proj" in n or "down_proj" in n) for n in whole), whole
    assert all("partial sum, one scale per output feature" in r for r in whole.values()), whole
    assert _forward(report) == {"all_reduce": DYNAMIC_FORWARD[name] * N_LAYERS}
    assert _verdict(report).strip() == "-> at the bound"  # collectives and bytes
    assert report.param_bytes_total == _float_bytes(trainable) + _part_bytes(report, trainable)


def test_quantized_activations_link_a_wide_attention_to_the_residual_stream():
    """Qwen3's attention is 8x the hidden width (4 heads of 128 over 64): o_proj narrows 512
    features to 64, as a low-rank factor would, but the next block's matmuls read it through
    the residual stream, and the bound's walk from their int8 activations sees that (it
    follows quantized integer data, not only float values), so the plan, gate / up colwise,
    is at the bound, not below one that paired o_proj with up_proj and called gate rowwise."""
    pytest.importorskip("torchao")
    model, ids = _torchao_llama("int8_dynamic_int8", family="qwen3")
    with torch.no_grad():
        report = _report(model, (ids,), 2)
    assert report.params["model.layers.0.mlp.gate_proj.weight_qdata"].style == "colwise"
    assert report.params["model.layers.0.self_attn.o_proj.weight_qdata"].style == "rowwise"
    assert _verdict(report).strip() == "-> at the bound"  # was "below the bound": misjudged
