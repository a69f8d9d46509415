"""The idiom corpus: one small transformer per way real projects write one step of a block.

Each model is the same skeleton (token embedding -> 2 pre-norm blocks -> RMSNorm -> LM head,
dim 64, 8 heads of 8, SwiGLU hidden 128, vocab 256, float32) with ONE step written in the
style of a known code base: a RoPE variant, a GQA repeat, a fused projection, raw-Parameter
matmuls, an MoE. Every other step is the plain baseline (``Attention``: separate q/k/v/o
Linears, causal SDPA, no positions; ``SwiGLU``: three Linears), so a model that misses its
Megatron bound points at its idiom. Each idiom is written as its code base writes it, not
as tpcompile would like it.

The models live by the step they write differently: :mod:`zoo.idioms.skeleton` (the baseline),
``positions``, ``projections``, ``attention``, ``mlps`` and ``blocks`` (how a block adds its
attention and MLP to the residual); ``diffusion`` holds the models of another skeleton, DiTs on
latents and timesteps (their inputs in ``INPUTS``); this module is the registry.
``IDIOMS[name]`` is a zero-argument factory, ``build(name)`` the deterministic model,
``EXPECT[name]`` what a Megatron-style plan of it is: which parameters are column-parallel,
row-parallel and replicated (fnmatch globs on parameter FQNs), and the all-reduces per layer.
``bench/idioms.py`` measures tpcompile against it; ``tests/unit/test_idioms_capture.py``
checks every model runs and is captured exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatch
from functools import partial

import torch
from torch import nn

from zoo.idioms.skeleton import Attention, D, HEADS, HEAD_DIM, LAYERS, LM, SwiGLU, VOCAB
from zoo.idioms.positions import (ALiBiAttention, InterleavedRoPE, LatentAttention, PairStackRoPE,
                                  PartialRoPE, RotateHalfRoPE, T5RelativeBias,
                                  TorchtitanAttention, UnboundPairsGQA)
from zoo.idioms.projections import (EinsumAttention, FullPrecisionQKNorm, FusedMQA, FusedQKV,
                                    IndexedMQA, MatmulLinear, NormalizedQK, RotaryMQA, SlicedQKV,
                                    SplitWeightQKV, TimmQKV, WholeQKNorm, FusedWholeQKNorm)
from zoo.idioms.attention import (BatchHeadsBmm, FloatMaskLM, Mamba2Mixer, MaskedSDPA,
                                  MaskedSoftmax, PaddingMaskLM, RepeatInterleaveKV, RepeatKV,
                                  RepeatTiledKV, SelectiveScan, SqueezedMQA, float_mask_inputs)
from zoo.idioms.blocks import ParallelDroppedOut, ParallelResidualFirst
from zoo.idioms.diffusion import (DiT, DroppedOutDiTBlock, GeluMLP, ReorderedSingleStreamBlock,
                                  SingleStreamDiT, TextTokensDiT, dit_inputs)
from zoo.idioms.mlps import (CastWeightsSwiGLU, EinsumMoE, FusedGateUp, GroupedExpertsLoop,
                             IndexPutMoE, InterleavedGateUp, ModuleListMoE, NormalizedSwiGLU,
                             PerLayerInputLM, RawParamSwiGLU, ReluSquaredMLP, ScaledTokensMoE,
                             StackedMoE, GroupNormMLP)

__all__ = ["IDIOMS", "EXPECT", "Expect", "INPUTS", "STYLES", "LAYERS", "VOCAB", "build",
           "example_inputs"]


# ----------------------------------------------------------------- what the plan should be

@dataclass(frozen=True)
class Expect:
    """A Megatron-style plan: globs on parameter FQNs and all-reduces per layer.

    Every trainable parameter matches exactly one of ``colwise``, ``rowwise``, ``replicated``
    and ``expert`` (stacked experts cut by whole experts).
    ``kv`` are column-parallel while the ``kv_heads`` KV heads can be split over the ranks, and
    replicated when there are fewer KV heads than ranks (Megatron's replicated KV groups). The
    whole k and v those compute on every rank have partial gradients, all-reduced in the
    attention input's bucket: no extra all-reduce. The all-reduces are per layer and training
    step: 1 + 1 per column -> row chain.
    """

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    replicated: tuple[str, ...] = ("embed.weight", "head.weight", "norm.weight",
                                 "layers.*.attn_norm.weight", "layers.*.mlp_norm.weight")
    fwd_allreduce_per_layer: int = 2
    bwd_allreduce_per_layer: int = 2
    kv: tuple[str, ...] = ()
    kv_heads: int = HEADS
    # (glob, fraction): the part of a fused column-parallel weight Megatron keeps whole too
    # (a fused qkv's kv rows under MQA, a Mamba-2 in_proj's B / C rows when there are fewer
    # groups than ranks)
    whole_part: tuple[tuple[str, float], ...] = ()
    expert: tuple[str, ...] = ()

    def at(self, world_size: int) -> "Expect":
        """The plan for ``world_size`` ranks, with ``kv`` resolved (and emptied)."""
        if world_size <= self.kv_heads:
            return replace(self, colwise=self.colwise + self.kv, kv=())
        return replace(self, replicated=self.replicated + self.kv, kv=())

    def style(self, fqn: str) -> str | None:
        """colwise | rowwise | replicate | expert for ``fqn`` (after ``at``); None if no glob
        names it."""
        for style, globs in (("colwise", self.colwise), ("rowwise", self.rowwise),
                             ("replicate", self.replicated), ("expert", self.expert)):
            if any(fnmatch(fqn, g) for g in globs):
                return style
        return None

    def cut(self, fqn: str) -> float:
        """The fraction of ``fqn`` a Megatron plan shards (0 for a replicated one)."""
        if self.style(fqn) == "replicate":
            return 0.0
        return 1.0 - next((f for g, f in self.whole_part if fnmatch(fqn, g)), 0.0)


def _in_layers(*globs: str) -> tuple[str, ...]:
    return tuple(f"layers.*.{g}" for g in globs)


ATTN_COL, ATTN_ROW = _in_layers("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"), \
    _in_layers("attn.wo.weight")
MLP_COL, MLP_ROW = _in_layers("mlp.w1.weight", "mlp.w3.weight"), _in_layers("mlp.w2.weight")
BASELINE = Expect(colwise=ATTN_COL + MLP_COL, rowwise=ATTN_ROW + MLP_ROW)


def attention_expect(col=ATTN_COL, row=ATTN_ROW, **kw) -> Expect:
    return Expect(colwise=col + MLP_COL, rowwise=row + MLP_ROW, **kw)


def mlp_expect(col=MLP_COL, row=MLP_ROW, **kw) -> Expect:
    return Expect(colwise=ATTN_COL + col, rowwise=ATTN_ROW + row, **kw)

# ----------------------------------------------------------------- the registry

MOE_EXPERTS = _in_layers("mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"), \
    _in_layers("mlp.experts.*.w2.weight")
_KV = _in_layers("attn.wk.weight", "attn.wv.weight")
# Experts sharded like SwiGLUs, their partial outputs weighted and summed, then ONE forward
# all-reduce. Backward: ONE too. The routing weights' gradient, <expert output, grad> over
# partial outputs, is a partial sum as well; the routing weights are computed from the block's
# input (not from a consumer of its synced copy), so both share one all-reduce.
MOE = dict(replicated=BASELINE.replicated + _in_layers("mlp.router.weight"))
# a hand plan of a DiT: attention heads and the MLP cut, one all-reduce each per block
# forward and backward; the conditioning (each block's timestep embedder, which the final
# layer calls again, and its adaLN modulation) on one row per sample kept whole by cost,
# the patch embed and the output projection whole
_DIT = Expect(colwise=ATTN_COL + _in_layers("mlp.fc1.weight", "mlp.fc1.bias"),
              rowwise=ATTN_ROW + _in_layers("mlp.fc2.weight"),
              replicated=("patch.*", "proj_out_1.*", "proj_out_2.*", "layers.*.mlp.fc2.bias")
              + _in_layers("emb.*", "adaLN.*"))
# Flux's single-stream blocks: q / k / v cut by heads and proj_mlp by columns; proj_out
# row-parallel over cat([attn, mlp]), each rank holding the rows of its heads and of its
# MLP slice: one all-reduce per block forward and backward. The shared conditioning, the
# per-head q / k norms and the patch embed and output layers whole
_SINGLE_STREAM = Expect(
    colwise=_in_layers("attn.wq.*", "attn.wk.*", "attn.wv.*", "proj_mlp.*"),
    rowwise=_in_layers("proj_out.weight"),
    replicated=("patch.*", "proj_out_1.*", "proj_out_2.*", "emb.*")
    + _in_layers("adaLN.*", "proj_out.bias", "attn.q_norm.weight", "attn.k_norm.weight"),
    fwd_allreduce_per_layer=1, bwd_allreduce_per_layer=1)
_TEXT_TOKENS = replace(_SINGLE_STREAM, replicated=_SINGLE_STREAM.replicated + ("context.*",))
_REGISTRY = [
    # name, factory, expected plan
    ("rope_rotate_half", lambda: LM(attn=RotateHalfRoPE), BASELINE),
    ("rope_gptj_interleaved", lambda: LM(attn=InterleavedRoPE), BASELINE),
    ("rope_neox_partial", lambda: LM(attn=PartialRoPE), BASELINE),
    ("torchtitan_llama3", lambda: LM(attn=TorchtitanAttention),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=2)),
    # at 4 ranks wk / wv whole: their partial gradients ride in the input's all-reduce
    ("rope_unbound_pairs_gqa", lambda: LM(attn=UnboundPairsGQA),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=2)),
    ("rope_pair_stack", lambda: LM(attn=PairStackRoPE), BASELINE),
    # q and the low-rank kv cut by heads; wkv_a (the latent and the one rotated k head) whole,
    # each rank slicing its heads of the expanded k_pe inside the cat at no cost. Megatron-LM
    # all-reduces the input gradient of each column-parallel linear: x's (wq) and the latent's
    # (wkv_b), backward 3; the latent's partial gradient can pass the norm and wkv_a (linear
    # in it) into x's, where wq's meets it (the whole weights' gradients ride along): 2
    ("mla_latent_rope_cat", lambda: LM(attn=LatentAttention),
     attention_expect(col=_in_layers("attn.wq.weight", "attn.wkv_b.weight"),
                      replicated=BASELINE.replicated + _in_layers("attn.wkv_a.weight",
                                                                  "attn.kv_norm.weight"))),
    ("alibi", lambda: LM(attn=ALiBiAttention), BASELINE),
    ("fused_qkv_unbind", lambda: LM(attn=FusedQKV),
     attention_expect(col=_in_layers("attn.wqkv.weight"))),  # per q / k / v chunk
    ("fused_qkv_timm", lambda: LM(attn=TimmQKV), attention_expect(col=_in_layers("attn.wqkv.weight"))),
    ("fused_qkv_slices", lambda: LM(attn=SlicedQKV), attention_expect(col=_in_layers("attn.wqkv.weight"))),
    # each piece of the split weight cut by heads as its part of the one root, bias too
    ("packed_weight_split", lambda: LM(attn=SplitWeightQKV),
     attention_expect(col=_in_layers("attn.in_proj_weight", "attn.in_proj_bias"))),
    # q's rows cut by heads, the kv head's rows whole on every rank (its gradient all-reduced
    # once: backward +1), as a separate k / v projection of one head is
    ("fused_qkv_mqa", lambda: LM(attn=FusedMQA),
     attention_expect(col=_in_layers("attn.wqkv.weight"), bwd_allreduce_per_layer=3,
                      whole_part=(("layers.*.attn.wqkv.weight", 2 * HEAD_DIM / (D + 2 * HEAD_DIM)),))),
    # the same with RoPE on the kv head as litgpt writes it: the head_dim halves of a head
    # whose rows are whole on every rank, rejoined by cat
    ("fused_qkv_mqa_rotary", lambda: LM(attn=RotaryMQA),
     attention_expect(col=_in_layers("attn.wqkv.weight"), bwd_allreduce_per_layer=3,
                      whole_part=(("layers.*.attn.wqkv.weight", 2 * HEAD_DIM / (D + 2 * HEAD_DIM)),))),
    # the bias table cut by heads with the scores it is added to (no gradient sync of its own)
    ("t5_relative_bias", lambda: LM(attn=T5RelativeBias),
     attention_expect(col=ATTN_COL + _in_layers("attn.relative_bias.weight"))),
    ("fused_qkv_mqa_indexed", lambda: LM(attn=IndexedMQA),
     attention_expect(col=_in_layers("attn.wqkv.weight"), bwd_allreduce_per_layer=3,
                      whole_part=(("layers.*.attn.wqkv.weight", 2 * HEAD_DIM / (D + 2 * HEAD_DIM)),))),
    ("einsum_qkv_3d", lambda: LM(attn=EinsumAttention),
     attention_expect(col=_in_layers("attn.wq", "attn.wk", "attn.wv"), row=_in_layers("attn.wo"))),
    ("mqa", lambda: LM(attn=partial(RepeatKV, n_kv_heads=1)),  # HF configs with 1 KV head
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=1)),
    # the kv head's head_dim is not cut (it would make the scores a partial sum): kept whole
    ("mqa_einsum_squeezed", lambda: LM(attn=partial(SqueezedMQA, n_kv_heads=1)),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=1)),
    ("gqa_expand_reshape", lambda: LM(attn=partial(RepeatKV, n_kv_heads=4)),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=4)),
    ("gqa_repeat_interleave", lambda: LM(attn=partial(RepeatInterleaveKV, n_kv_heads=4)),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=4)),
    # each rank's query heads are those of its kv heads in every tile: wq cut in n_rep blocks
    ("gqa_repeat_tiled", lambda: LM(attn=partial(RepeatTiledKV, n_kv_heads=4)),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=4)),
    ("softmax_masked_fill", lambda: LM(attn=MaskedSoftmax), BASELINE),
    ("bmm_batch_heads_merged", lambda: LM(attn=BatchHeadsBmm), BASELINE),
    # the norms' weights are cut with the features they scale; per norm one forward all-reduce
    # of its statistic, and backward one for both (each statistic's gradient sums over the cut
    # features; the two are bucketed)
    ("qk_norm_whole", lambda: LM(attn=WholeQKNorm),
     attention_expect(col=ATTN_COL + _in_layers("attn.q_norm.weight", "attn.k_norm.weight"),
                      fwd_allreduce_per_layer=4, bwd_allreduce_per_layer=3)),
    # Wan's fused ``nn.RMSNorm`` over every head: planned through its decomposition, as above
    ("qk_rmsnorm_whole_fused", lambda: LM(attn=FusedWholeQKNorm),
     attention_expect(col=ATTN_COL + _in_layers("attn.q_norm.weight", "attn.k_norm.weight"),
                      fwd_allreduce_per_layer=4, bwd_allreduce_per_layer=3)),
    ("swiglu_linear", lambda: LM(), BASELINE),
    # unit-norm q / k per head: head_dim is whole on every rank, nothing to reduce; sqk, read
    # by q and k through one view, is whole on every rank, its gradient synced in the
    # attention input's all-reduce
    ("qk_normalize_per_head", lambda: LM(attn=NormalizedQK),
     attention_expect(replicated=BASELINE.replicated + _in_layers("attn.sqk"))),
    # the per-head norms' weights are whole on every rank (as Megatron's q / k layernorms):
    # their partial gradients ride in the attention input's all-reduce
    ("qk_norm_autocast_off", lambda: LM(attn=FullPrecisionQKNorm),
     attention_expect(replicated=BASELINE.replicated + _in_layers("attn.q_norm.weight",
                                                                  "attn.k_norm.weight"))),
    # channels cut from in_proj through the conv, the scan and D to out_proj; x_proj's (dt, B, C)
    # are a partial sum over channels, all-reduced once (forward), as is their gradient
    ("mamba_selective_scan", lambda: LM(attn=SelectiveScan),
     attention_expect(col=_in_layers("attn.in_proj.weight", "attn.conv1d.*", "attn.dt_proj.*",
                                     "attn.A_log", "attn.D"),
                      row=_in_layers("attn.x_proj.weight", "attn.out_proj.weight"),
                      fwd_allreduce_per_layer=3, bwd_allreduce_per_layer=3)),
    # x, z, dt and the per-head parameters cut by heads; B / C (one group) computed whole on
    # every rank from in_proj's and conv1d's whole rows, whose gradients are all-reduced once
    # (backward +1); the gated norm over all of d_inner all-reduces its statistic (+1 / +1)
    ("mamba2_one_group", lambda: LM(attn=Mamba2Mixer),
     attention_expect(col=_in_layers("attn.in_proj.weight", "attn.conv1d.*", "attn.dt_bias",
                                     "attn.A_log", "attn.D", "attn.norm.weight"),
                      row=_in_layers("attn.out_proj.weight"),
                      whole_part=(("layers.*.attn.in_proj.weight", 32 / 296),
                                  ("layers.*.attn.conv1d.weight", 32 / 160),
                                  ("layers.*.attn.conv1d.bias", 32 / 160)),
                      fwd_allreduce_per_layer=3, bwd_allreduce_per_layer=4)),
    ("swiglu_raw_params", lambda: LM(mlp=RawParamSwiGLU),
     mlp_expect(col=_in_layers("mlp.w_gate", "mlp.w_up"), row=_in_layers("mlp.w_down"))),
    ("swiglu_cast_weights", lambda: LM(mlp=CastWeightsSwiGLU), mlp_expect()),
    ("mlp_relu_squared", lambda: LM(mlp=ReluSquaredMLP),
     mlp_expect(col=_in_layers("mlp.w1.weight"))),
    # the gain cut with the hidden features; the norm's sum of squares all-reduced forward
    # (+1), its gradient backward (+1)
    ("mlp_normalize_hidden", lambda: LM(mlp=NormalizedSwiGLU),
     mlp_expect(col=MLP_COL + _in_layers("mlp.gain"), fwd_allreduce_per_layer=3,
                bwd_allreduce_per_layer=3)),
    # GroupNorm over the hidden channels, whole groups on each rank: nothing reduced
    ("mlp_group_norm", lambda: LM(mlp=GroupNormMLP),
     mlp_expect(col=_in_layers("mlp.w1.*", "mlp.norm.*"), row=_in_layers("mlp.w2.weight"),
                replicated=BASELINE.replicated + _in_layers("mlp.w2.bias"))),
    ("swiglu_fused_gate_up", lambda: LM(mlp=FusedGateUp),
     mlp_expect(col=_in_layers("mlp.gate_up_proj.weight"),  # per gate / up chunk
                row=_in_layers("mlp.down_proj.weight"))),
    ("swiglu_interleaved_gate_up", lambda: LM(mlp=InterleavedGateUp),
     mlp_expect(col=_in_layers("mlp.gate_up_proj.weight"),  # in whole (gate, up) pairs
                row=_in_layers("mlp.down_proj.weight"))),
    ("linear_subclass_matmul", lambda: LM(attn=partial(Attention, linear=MatmulLinear),
                                          mlp=partial(SwiGLU, linear=MatmulLinear)), BASELINE),
    ("moe_modulelist_top2", lambda: LM(mlp=ModuleListMoE),
     mlp_expect(*MOE_EXPERTS, **MOE)),
    ("moe_litgpt_index_put", lambda: LM(mlp=IndexPutMoE),
     mlp_expect(col=_in_layers("mlp.experts.*.fc_1.weight", "mlp.experts.*.fc_2.weight"),
                row=_in_layers("mlp.experts.*.proj.weight"),
                replicated=BASELINE.replicated + _in_layers("mlp.gate.weight"))),
    ("moe_stacked_bmm", lambda: LM(mlp=StackedMoE),
     mlp_expect(col=_in_layers("mlp.w1", "mlp.w3"), row=_in_layers("mlp.w2"), **MOE)),
    # each expert's w1[e] / w3[e] / w2[e] picked inside the loop: the stacked weights stored cut
    # like every expert's columns / rows, each rank its part of every expert; their partial
    # outputs, padded and put back into zeros, join the shared expert's: one all-reduce
    ("moe_grouped_loop", lambda: LM(mlp=GroupedExpertsLoop),
     mlp_expect(col=_in_layers("mlp.w1", "mlp.w3", "mlp.shared.w1.weight", "mlp.shared.w3.weight"),
                row=_in_layers("mlp.w2", "mlp.shared.w2.weight"), **MOE)),
    # tokens broadcast over the experts (einsum "td,ehd->eth"): the experts are the first dim
    # only the weight and the output carry, cut whole under the default experts="tensor" too
    ("moe_einsum", lambda: LM(mlp=EinsumMoE),
     Expect(colwise=ATTN_COL, rowwise=ATTN_ROW, expert=_in_layers("mlp.w1", "mlp.w2", "mlp.w3"),
            **MOE)),
    # the routed tokens' gradient sync shares one all-reduce with the shared expert's input
    ("moe_scaled_tokens", lambda: LM(mlp=ScaledTokensMoE),
     mlp_expect(col=_in_layers("mlp.gate_up", "mlp.shared.w1.weight", "mlp.shared.w3.weight"),
                row=_in_layers("mlp.down", "mlp.shared.w2.weight"), **MOE)),
    # a third chain per block (gate -> project); the per-layer inputs' gradient sync, made before
    # the blocks, shares the first block's first all-reduce
    ("per_layer_inputs", PerLayerInputLM,
     Expect(colwise=BASELINE.colwise + _in_layers("gate.weight"),
            rowwise=BASELINE.rowwise + _in_layers("project.weight"),
            replicated=BASELINE.replicated + ("embed_per_layer.weight", "per_layer_proj.weight",
                                              "per_layer_norm.weight"),
            fwd_allreduce_per_layer=3, bwd_allreduce_per_layer=3)),
    ("sdpa_padding_mask", lambda: PaddingMaskLM(attn=MaskedSDPA), BASELINE),
    ("mqa_sdpa_broadcast", lambda: LM(attn=partial(Attention, n_kv_heads=1)),  # Falcon
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=1)),
    # attention and MLP side by side on one norm, the residual added first: wo's and w2's
    # partial sums and the residual (rank 0's share) summed, then ONE forward all-reduce; the
    # norm's output enters both chains through one gradient sync: ONE backward
    ("parallel_block_residual_first", lambda: LM(block=ParallelResidualFirst),
     Expect(colwise=BASELINE.colwise, rowwise=BASELINE.rowwise,
            replicated=("embed.weight", "head.weight", "norm.weight", "layers.*.norm.weight"),
            fwd_allreduce_per_layer=1, bwd_allreduce_per_layer=1)),
    # each branch dropped out before the sum, the MLP's output bias inside it: both partial
    # sums carried through their dropouts (one mask, drawn alike on every rank): ONE forward
    # all-reduce, ONE backward
    ("parallel_block_dropped_out", lambda: LM(mlp=GeluMLP, block=ParallelDroppedOut),
     Expect(colwise=ATTN_COL + _in_layers("mlp.fc1.weight", "mlp.fc1.bias"),
            rowwise=ATTN_ROW + _in_layers("mlp.fc2.weight"),
            replicated=("embed.weight", "head.weight", "norm.weight", "layers.*.norm.*",
                        "layers.*.mlp.fc2.bias"),
            fwd_allreduce_per_layer=1, bwd_allreduce_per_layer=1)),
    # a DiT and Flux's single-stream blocks at a hand plan (_DIT, _SINGLE_STREAM)
    ("dit_adaln_zero", DiT, _DIT),
    ("dit_single_stream", SingleStreamDiT, _SINGLE_STREAM),
    # AuraFlow: each branch dropped out before its gate; reduced at the projection all the
    # same, so the gate's gradient comes out whole
    ("dit_gate_after_dropout", lambda: DiT(block=DroppedOutDiTBlock), _DIT),
    # Flux's stack: text tokens beside the image's, dropped after the last block (whose text
    # rows feed nothing); the conditioning's text projection whole with the rest of it
    ("dit_single_stream_text_tokens", TextTokensDiT, _TEXT_TOKENS),
    # HunyuanImage: q / k / v read the normed tokens reassembled from two slices, the MLP
    # reads them whole: their gradients summed once, at the normed tokens
    ("dit_single_stream_reordered", lambda: TextTokensDiT(block=ReorderedSingleStreamBlock),
     _TEXT_TOKENS),
    # PixArt / Sana: the caller's float mask made into every head's additive bias; it asks
    # no gradient, so it rides in no all-reduce
    ("sdpa_float_mask_input", lambda: FloatMaskLM(attn=MaskedSDPA), BASELINE),
]
# what each idiom writes its own way, for the support table bench/idioms.py generates
STYLES = {
    "rope_rotate_half": "HF Llama RoPE: `q * cos + rotate_half(q) * sin`",
    "rope_gptj_interleaved": "GPT-J RoPE on pairs `x[..., 0::2]`, `x[..., 1::2]`, `stack(..., -1).flatten(-2)`",
    "rope_neox_partial": "GPT-NeoX partial rotary: `cat(rotated q[..., :rd], q[..., rd:])`",
    "torchtitan_llama3": "torchtitan Llama 3: `view_as_complex` RoPE, `view(bs, T, -1, hd)`, SDPA `enable_gqa`, 8 q / 2 kv heads",
    "rope_unbound_pairs_gqa": "x-transformers RoPE: pairs by `reshape(..., -1, 2).unbind(-1)`, `stack((-x2, x1), -1)`, 8 q / 2 kv heads tiled by `expand` + `reshape`",
    "rope_pair_stack": "RoPE by `reshape(..., -1, 2)`, `stack([...], -1).flatten(3)`",
    "mla_latent_rope_cat": "DeepSeek-V3 MLA (torchtitan): `cat([k_nope, k_pe.expand(-1, -1, H, -1)], -1)` of per-head and one shared rotated head, low-rank `wkv_a` -> `RMSNorm` -> `wkv_b`",
    "alibi": "BLOOM / MPT ALiBi: per-head distance biases added to explicit scores",
    "fused_qkv_unbind": "one qkv Linear, `view(B, T, 3, H, D).unbind(2)`",
    "fused_qkv_timm": "timm / DiT: `reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`",
    "fused_qkv_slices": "Phi-3 `qkv_proj` cut by uneven slices `qkv[..., :q_pos]` (8 q / 4 kv heads)",
    "packed_weight_split": "`nn.MultiheadAttention` cross-attention: `in_proj_weight.split([E, 2E])`, one `F.linear` per piece",
    "fused_qkv_mqa": "GPT-BigCode: one `c_attn` for 8 q heads and 1 kv head, `split`, kv `expand`ed",
    "fused_qkv_mqa_rotary": "litgpt, one query group: qkv `split` on features, k `view(B, T, 1, hd)`, RoPE `cat((-x2, x1))`, `repeat_interleave`",
    "t5_relative_bias": "T5 / CPM-Ant: `nn.Embedding(buckets, heads)` of relative positions added to the scores",
    "fused_qkv_mqa_indexed": "Falcon-7B: `qkv.view(B, T, H + 2, D)`, k / v picked by list indices `qkv[..., [-2], :]`",
    "einsum_qkv_3d": "Flax / Gemma ports: `einsum(\"bld,dhk->blhk\")` with 3-D weights",
    "mqa": "multi-query (1 kv head), HF `repeat_kv` by expand + reshape",
    "mqa_einsum_squeezed": "x-transformers multi-query: kv head squeezed to `(B, T, d)`, `einsum(\"b h i d, b j d -> b h i j\")`",
    "gqa_expand_reshape": "GQA 8 q / 4 kv heads, HF `repeat_kv` by expand + reshape",
    "gqa_repeat_interleave": "GQA 8 q / 4 kv heads by `repeat_interleave` on the head dim",
    "gqa_repeat_tiled": "x-transformers GQA 8 q / 4 kv heads, `repeat(k, 'b kvh n d -> b (r kvh) n d')`: kv heads tiled",
    "softmax_masked_fill": "nanoGPT explicit attention: `masked_fill` with a tril buffer, softmax, `@ v`",
    "qk_norm_whole": "OLMo 2: RMSNorm over the whole q and k projections, before the head split",
    "bmm_batch_heads_merged": "BART / XGLM: batch and heads merged, reshape(B * H, T, d) and bmm",
    "qk_normalize_per_head": "nGPT / cosine attention: `F.normalize(q, dim=-1) * sqk.view(1, 1, H, hd)` per head",
    "qk_norm_autocast_off": "per-head q / k RMSNorm in float32 inside `torch.autocast(..., enabled=False)`",
    "mlp_normalize_hidden": "nGPT-style `F.normalize(h, dim=-1) * gain` over a SwiGLU's hidden features",
    "swiglu_linear": "SwiGLU with three `nn.Linear` (the baseline)",
    "mamba_selective_scan": "Mamba mixer: depthwise causal `conv1d`, `x_proj` split into dt / B / C, segment-sum scan",
    "mamba2_one_group": "Mamba-2 (Bamba): fused in_proj to (z, xBC, dt), B / C of one group `repeat_interleave`d to the heads, `einsum` SSD, gated norm",
    "swiglu_raw_params": "SwiGLU on raw Parameters: `x @ w_gate`, `einsum(\"btd,dh->bth\")`",
    "swiglu_cast_weights": "weights cast where they are used (`F.linear(x.double(), self.w1.weight.double())`, torchtitan's `w1.bfloat16()` experts, Hugging Face's float32 router)",
    "mlp_relu_squared": "ReLU² MLP: `square(relu(w1 x))`",
    "mlp_group_norm": "a UNet / audio-style MLP over channels: `w2(silu(GroupNorm(w1(x).transpose(1, 2))))`, groups of 16 channels",
    "qk_rmsnorm_whole_fused": "Wan 2.x / LTX (diffusers `rms_norm_across_heads`): `nn.RMSNorm(heads * head_dim)` (ATen's fused `rms_norm`) on q and k",
    "swiglu_fused_gate_up": "one `gate_up_proj` Linear, `chunk(2, -1)`",
    "swiglu_interleaved_gate_up": "gpt-oss: gate and up features alternate, `h[..., ::2]`, `h[..., 1::2]`",
    "linear_subclass_matmul": "a Linear subclass computing `x @ self.weight.T`",
    "moe_modulelist_top2": "Mixtral loop over a ModuleList of experts: `index_select`, `index_add_`",
    "moe_litgpt_index_put": "litgpt Mixtral: a loop over a ModuleList of experts, `y[token_idx] += probs * expert(x[token_idx])` (a gather, `add_`, `index_put_` once exported)",
    "moe_stacked_bmm": "stacked `(experts, out, in)` expert weights through `bmm`, dense gating",
    "moe_grouped_loop": "torchtitan `GroupedExperts` for-loop: tokens `argsort`ed, counted by int64 `histc`, `split` by the counts, `w1[e]` per expert, `vstack` with `new_zeros`, a shared expert",
    "moe_einsum": "stacked experts by `einsum(\"td,ehd->eth\")` over tokens broadcast to them, combined by `einsum(\"te,etd->td\")`",
    "moe_scaled_tokens": "Llama 4: tokens `repeat`ed per expert times sigmoid scores, stacked `(experts, in, out)` gate_up through `bmm`, a shared expert",
    "per_layer_inputs": "Gemma 3n / 4 per-layer inputs: a `(B, T, layers, P)` tensor made before the blocks, block i gated by `inputs[:, :, i, :]`",
    "sdpa_padding_mask": "HF-style `(B, 1, T, T)` boolean padding + causal mask into SDPA",
    "mqa_sdpa_broadcast": "Falcon: 1 kv head broadcast inside SDPA",
    "parallel_block_residual_first": "Cohere / litgpt `parallel_residual`: one norm, `x + attn(ln(x)) + mlp(ln(x))` with the residual added first",
    "parallel_block_dropped_out": "GPT-J / CodeGen / GPT-NeoX / Phi: one norm, `dropout(attn(h)) + dropout(mlp(h)) + x`, the MLP's biases",
    "dit_adaln_zero": "diffusers DiT (`ada_norm_zero`): Conv2d patch embed, a timestep embedder MLP per block (the final layer calls block 0's again), `Linear(D, 6D)` adaLN-Zero modulation, `proj_out_1` / `proj_out_2`",
    "dit_single_stream": "diffusers Flux `FluxSingleTransformerBlock`: adaLN-single `Linear(D, 3D)`, attention (per-head q / k RMSNorm, no `to_out`) and a GELU MLP side by side, ONE `proj_out` over `cat([attn, mlp], -1)`",
    "dit_gate_after_dropout": "AuraFlow: `x + gate * dropout(attn(...))`, each branch dropped out between its projection and its adaLN-Zero gate",
    "dit_single_stream_text_tokens": "Flux's stack: text tokens `cat`ed before the image's, through every single-stream block, dropped after the last (`x[:, text:]`)",
    "dit_single_stream_reordered": "HunyuanImage single-stream: attention reads `cat([h[:, :-text], h[:, -text:]])`, the MLP reads `h`",
    "sdpa_float_mask_input": "PixArt / Sana: the caller's float mask `(1 - mask) * -10000` added to every head's scores in SDPA",
}
# idiom -> its inputs ``(batch, seq, seed) -> tuple`` when not token ids: ``seq`` tokens
INPUTS = {"dit_adaln_zero": dit_inputs, "dit_single_stream": dit_inputs,
          "dit_gate_after_dropout": dit_inputs, "dit_single_stream_text_tokens": dit_inputs,
          "dit_single_stream_reordered": dit_inputs, "sdpa_float_mask_input": float_mask_inputs}
IDIOMS = {name: factory for name, factory, _ in _REGISTRY}
EXPECT = {name: expect for name, _, expect in _REGISTRY}


def build(name: str, seed: int = 0) -> nn.Module:
    """Idiom ``name`` with deterministic weights."""
    torch.manual_seed(seed)
    return IDIOMS[name]()


def example_inputs(batch: int = 2, seq: int = 16, seed: int = 0, name: str = "") -> tuple:
    """Idiom ``name``'s inputs of ``batch`` samples of ``seq`` tokens (token ids by default)."""
    if name in INPUTS:
        return INPUTS[name](batch, seq, seed)
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, seq), generator=g),)
