"""Megatron's bound derived from the model (tpcompile/inspect/bound/bound.py) against Megatron's plans
known independently: the idiom corpus's hand-written ``Expect`` (styles and all-reduces per
layer), the built-in models, LoRA and quantized copies (the base model's plan), and the
``base_model_tp_plan`` transformers ships with its models. Capture only: nothing is planned.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from fnmatch import fnmatch

import pytest
import torch

from tpcompile.core.capture import capture
from tpcompile.inspect.bound.bound import megatron_bound
from tpcompile.passes import pipeline
from tpcompile.tools import models
from zoo import idioms, lora_models, quant_models

def captured(model, inputs, kwargs=None):
    """The graph the planner starts from: captured, then prepared."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, inputs, kwargs, dynamic=False)
        gm, _ = pipeline.run_passes(cap.gm, pipeline.PREPARE_PASSES)
    return replace(cap, gm=gm)


def _counts(bound) -> set[tuple[int, int]]:
    return {(b.forward, b.backward) for b in bound.blocks.values()}


@pytest.mark.parametrize("name", sorted(idioms.IDIOMS))
def test_idiom_bound_is_the_corpus_plan(name):
    cap = captured(idioms.build(name), idioms.example_inputs(2, 16, name=name))
    for ws in (2, 4):
        expect, bound = idioms.EXPECT[name].at(ws), megatron_bound(cap, ws)
        for w, style in bound.styles.items():
            if w in cap.trainable:
                want = {"replicate": "whole"}.get(expect.style(w), expect.style(w))
                if want == "expert":  # cut by whole experts: Megatron's expert-TP cuts it too
                    want = style if style in ("colwise", "rowwise") else "colwise or rowwise"
                assert style == want, (ws, w, bound.reasons.get(w))
                if style != "whole":  # a fused weight's rows Megatron keeps whole
                    assert 1 - bound.whole_rows.get(w, 0.0) == pytest.approx(expect.cut(w)), w
        want = (expect.fwd_allreduce_per_layer, expect.bwd_allreduce_per_layer)
        (got,) = _counts(bound)
        assert len(bound.blocks) == 2 and not bound.undecided
        assert got == want, (ws, got, [b.whole_grads for b in bound.blocks.values()])


@pytest.mark.parametrize("name,ws,whole", [
    ("llama", 2, set()),
    ("llama", 4, {"attention.wk", "attention.wv"}),  # 2 KV heads on 4 ranks
    ("gpt2", 4, set()),
    ("mlp", 4, set()),
])
def test_builtin_bound(name, ws, whole):
    model = models.build(name)
    bound = megatron_bound(captured(model, models.example_inputs(model)), ws)
    chains = 1 if name == "mlp" else 2
    assert _counts(bound) == {(chains, chains)}
    first = min(bound.blocks) + "."
    assert {w.removeprefix(first).removesuffix(".weight") for w, s in bound.styles.items()
            if w.startswith(first) and s == "whole"} == whole
    for w, why in bound.reasons.items():  # around the blocks: the LM head
        outside = not any(w.startswith(b + ".") for b in bound.blocks)
        assert why == ("its output reaches no row-parallel matmul" if outside
                       else f"2 head(s), fewer than the {ws} ranks"), (w, why)
    assert bound.outside is None or (bound.outside.forward, bound.outside.backward) == (0, 0)
    assert bound.ideal_bytes < sum(p.numel() * 4 for p in model.parameters())


class _Projected(torch.nn.Module):
    """LLaVA's multimodal projector / Wan's text embedder: an MLP before the blocks."""

    def __init__(self, dim=32):
        super().__init__()
        self.proj_in, self.proj_out = torch.nn.Linear(16, dim), torch.nn.Linear(dim, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
            for _ in range(2))

    def forward(self, x):
        h = self.proj_out(torch.nn.functional.gelu(self.proj_in(x)))
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_a_chain_around_the_blocks_is_judged_like_one_inside():
    """The projector is a column -> row chain (Megatron-LM's ``MultimodalProjector``): one
    forward all-reduce; backward none (its input is the caller's data)."""
    bound = megatron_bound(captured(_Projected(), (torch.randn(2, 5, 16),)), 2)
    assert bound.styles["proj_in.weight"] == "colwise" and bound.styles["proj_out.weight"] == "rowwise"
    assert (bound.outside.forward, bound.outside.backward) == (1, 0)
    assert _counts(bound) == {(1, 1)}


def test_lora_bound_is_the_base_models():
    """Adapters add no collective; Megatron splits an adapter's wide factor and keeps its
    rank-wide side whole: A whole / B colwise on a column-parallel linear, A rowwise / B whole
    on a row-parallel one."""
    model, inputs, kwargs, base = lora_models.build("llama")
    lora, plain = (megatron_bound(captured(m, inputs, kwargs), 2) for m in (model, base))
    # the frozen base asks no input gradient; the adapters' trainable factors ask what a
    # trainable base would: Megatron's 2 / 2, and nothing more
    assert _counts(lora) == {(2, 2)} and _counts(plain) == {(2, 0)}
    for path, (w, a, b) in lora_models.adapters(model).items():
        style = plain.styles[lora_models.base_fqn(path)]
        assert lora.styles[w] == style
        assert (lora.styles[a], lora.styles[b]) == (
            ("whole", "colwise") if style == "colwise" else ("rowwise", "whole")), path


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_bound_is_the_base_models(kind):
    model, inputs = quant_models.build(kind)
    base = models.build("llama", n_kv_heads=4)
    quant, plain = megatron_bound(captured(model, inputs), 4), \
        megatron_bound(captured(base, inputs), 4)
    assert _counts(plain) == {(2, 2)}
    assert _counts(quant) == {(2, 0)}  # nothing trainable: backward asks no input gradient
    assert quant.styles == plain.styles
    assert quant.ideal_bytes < plain.ideal_bytes  # integer block weights


# the entries of a model's base_model_tp_plan that cut a weight by output or input features
PLAIN = {"colwise": "colwise", "packed_colwise": "colwise", "rowwise": "rowwise"}
TP_PLAN_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Gemma2ForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM")


@pytest.mark.parametrize("family", TP_PLAN_FAMILIES)
def test_bound_agrees_with_transformers_tp_plan(family):
    """Every weight a family's ``base_model_tp_plan`` splits colwise or rowwise (stacked
    experts' packed gate / up: colwise), the bound splits the same way (or keeps whole, saying
    why: fewer heads than ranks)."""
    pytest.importorskip("transformers")
    from bench import hf_sweep

    model = hf_sweep.build(family)
    plan = {k: PLAIN[v] for k, v in (model.config.base_model_tp_plan or {}).items() if v in PLAIN}
    assert plan, family
    bound = megatron_bound(captured(model, (hf_sweep.example_ids(),)), 2)
    prefix = model.base_model_prefix + "."
    checked = 0
    for w, style in bound.styles.items():
        name = w.removeprefix(prefix)  # a Linear's weight, or a stacked experts' Parameter
        want = next((v for k, v in plan.items()
                     if fnmatch(name, k) or fnmatch(name.rpartition(".")[0], k)), None)
        if want is None or w.endswith(".bias"):
            continue
        checked += 1
        assert style == want or (style == "whole" and "head(s)" in bound.reasons[w]), (
            w, style, want, bound.reasons.get(w))
    assert checked >= 2 * len(bound.blocks), (family, checked)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_explain_reports_the_derived_bound(name):
    """``explain``'s bound columns are :func:`megatron_bound`'s, block by block; around the
    blocks it is derived too, and an LM pays nothing there."""
    import tpcompile

    model = models.build(name)
    inputs = models.example_inputs(model)
    bound = megatron_bound(captured(model, inputs), 2)
    report = tpcompile.explain(model, inputs, 2)
    rows = {m.layer: (m.bound_forward, m.bound_backward, m.bound_bytes) for m in report.megatron}
    assert rows == {layer: (b.forward, b.backward, b.bytes) for layer, b in bound.blocks.items()}
    assert (bound.outside.forward, bound.outside.backward) == (0, 0)  # the LM head whole



def test_syncs_that_wait_through_the_models_own_code_are_not_bucketed():
    """Backward syncs share one all-reduce only when none waits on another's matmuls. Dory
    (transformers) applies its layer twice, the second pass reading the first's output through
    the model's own code, outside the block: each pass's syncs wait on the one before, 8 per
    layer as the plan pays; a walk that stopped at the block's edge had found 6 and called the
    plan above the bound."""
    pytest.importorskip("transformers")
    from bench.hf_configs import build, example_ids
    from tpcompile.inspect.explain.explain import explain
    from tpcompile.inspect.traffic import bound_verdict

    model, ids = build("DoryForCausalLM"), example_ids()
    assert _counts(megatron_bound(captured(model, (ids,)), 2)) == {(8, 8)}
    # as many collectives as the bound; the bytes of nGPT's per-head sqk, kept whole (as in
    # the idiom qk_normalize_per_head, tests/gloo/test_idioms.py's BYTES_OVER_BOUND), beyond it
    verdict = bound_verdict(explain(model, (ids,), world_size=2).megatron)
    assert verdict.startswith("above the bound: +512 bytes beyond"), verdict


class _OneFrame(torch.nn.Module):
    """A temporal transformer's block as diffusers' ``TransformerTemporalModel`` runs it over a
    clip of one frame: every pixel a sequence of one token, ``(B * H * W, 1, D)``."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(y.transpose(1, 2).flatten(2))


def test_a_token_dim_of_one_is_not_a_head():
    """The 1 before a projection's features in ``(B * H * W, 1, D)`` is the frames of a
    one-frame clip: the bound read it as one head, fewer than the ranks, kept q / k / v whole
    and counted one backward all-reduce where the plan, cutting the 2 heads, pays one per
    chain (diffusers' TransformerTemporalModel: 3/1 against 3/3)."""
    bound = megatron_bound(captured(_OneFrame(), (torch.randn(8, 1, 32),)), 2)
    assert {bound.styles[f"{p}.weight"] for p in "qkv"} == {"colwise"}, bound.styles
    assert bound.styles["o.weight"] == "rowwise"


def test_a_latent_not_narrower_than_a_quarter_of_the_model_is_still_mla():
    """MLA whose down projection does not narrow its input 4x (torchtitan's DeepSeek-V3 debug
    config: 256 -> 576): its latent, normalized whole and expanded at least 4x into heads by
    ``wkv_b``, still makes ``wkv_a`` the whole down factor of a low-rank pair, with the counts
    of the narrow latent; the same pair without the norm is two matmuls of a chain."""
    from zoo.idioms.positions import LatentAttention
    from zoo.idioms.skeleton import LM

    class WideLatent(LatentAttention):
        RANK = 24  # wkv_a: 64 -> 32, wkv_b: 24 -> 128

    class Unnormed(WideLatent):
        def __init__(self):
            super().__init__()
            self.kv_norm = torch.nn.Identity()

    inputs = idioms.example_inputs(2, 16)
    narrow = megatron_bound(captured(LM(attn=LatentAttention), inputs), 2)
    for attn, down in ((WideLatent, "whole"), (Unnormed, "colwise")):
        bound = megatron_bound(captured(LM(attn=attn), inputs), 2)
        styles = {w.split("attn.")[-1]: s for w, s in bound.styles.items() if "layers.0.attn" in w}
        assert styles["wkv_a.weight"] == down, styles
        if down == "whole":
            assert styles == {w.split("attn.")[-1]: s for w, s in narrow.styles.items()
                              if "layers.0.attn" in w}
            assert _counts(bound) == _counts(narrow)
