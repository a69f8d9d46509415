"""The idiom corpus: one small transformer per way real projects write one step of a block.

Each model is the same skeleton (token embedding -> 2 pre-norm blocks -> RMSNorm -> LM head,
dim 64, 8 heads of 8, SwiGLU hidden 128, vocab 256, float32) with ONE step written in the
style of a known code base: a RoPE variant, a GQA repeat, a fused projection, raw-Parameter
matmuls, an MoE. Every other step is the plain baseline (``Attention``: separate q/k/v/o
Linears, causal SDPA, no positions; ``SwiGLU``: three Linears), so a model that misses its
Megatron bound points at its idiom. Each idiom is written as its code base writes it, not
as tpcompile would like it.

``IDIOMS[name]`` is a zero-argument factory, ``build(name)`` the deterministic model,
``EXPECT[name]`` what a Megatron-style plan of it is: which parameters are column-parallel,
row-parallel and replicated (fnmatch globs on parameter FQNs), and the all-reduces per layer.
``bench/idioms.py`` measures tpcompile against it; ``tests/unit/test_idioms_capture.py``
checks every model runs and is captured exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IDIOMS", "EXPECT", "Expect", "STYLES", "build", "example_inputs"]

D, HEADS, HIDDEN, VOCAB, LAYERS, MAX_SEQ = 64, 8, 128, 256, 2, 64
HEAD_DIM = D // HEADS


# ----------------------------------------------------------------- what the plan should be

@dataclass(frozen=True)
class Expect:
    """A Megatron-style plan: globs on parameter FQNs and all-reduces per layer.

    Every trainable parameter matches exactly one of ``colwise``, ``rowwise``, ``replicated``.
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
    # (a Mamba-2 in_proj's B / C rows when there are fewer groups than ranks)
    whole_part: tuple[tuple[str, float], ...] = ()

    def at(self, world_size: int) -> "Expect":
        """The plan for ``world_size`` ranks, with ``kv`` resolved (and emptied)."""
        if world_size <= self.kv_heads:
            return replace(self, colwise=self.colwise + self.kv, kv=())
        return replace(self, replicated=self.replicated + self.kv, kv=())

    def style(self, fqn: str) -> str | None:
        """colwise | rowwise | replicate for ``fqn`` (after ``at``); None if no glob names it."""
        for style, globs in (("colwise", self.colwise), ("rowwise", self.rowwise),
                             ("replicate", self.replicated)):
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


# ----------------------------------------------------------------- the shared skeleton

class RMSNorm(nn.Module):
    def __init__(self, dim: int = D, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    """Baseline: separate q/k/v/o Linears, (B, T, heads, head_dim) views, causal SDPA.

    Idioms override one step: ``init_projections`` + ``project`` (x -> q, k, v as
    (B, T, heads, head_dim)), ``position`` (q, k -> rotated q, k), ``attend`` (q, k, v as
    (B, heads, T, head_dim) -> (B, heads, T, head_dim)), or ``output``.
    """

    def __init__(self, n_heads: int = HEADS, n_kv_heads: int | None = None, linear=nn.Linear):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = D // n_heads
        self.init_projections(linear)

    def init_projections(self, linear):
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wq, self.wk, self.wv = (linear(D, n, bias=False) for n in (q, kv, kv))
        self.wo = linear(q, D, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        return (self.wq(x).view(B, T, self.n_heads, self.head_dim),
                self.wk(x).view(B, T, self.n_kv_heads, self.head_dim),
                self.wv(x).view(B, T, self.n_kv_heads, self.head_dim))

    def position(self, q, k):
        return q, k

    def attend(self, q, k, v, *extra):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def output(self, y):
        B, T = y.shape[:2]
        return self.wo(y.reshape(B, T, -1))

    def forward(self, x, *extra):
        q, k, v = self.project(x)
        q, k = self.position(q, k)
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *extra)
        return self.output(y.transpose(1, 2))


class SwiGLU(nn.Module):
    """Baseline MLP (idiom ``swiglu_linear``): w2(silu(w1 x) * w3 x) with three nn.Linear."""

    def __init__(self, hidden: int = HIDDEN, linear=nn.Linear):
        super().__init__()
        self.w1, self.w3 = linear(D, hidden, bias=False), linear(D, hidden, bias=False)
        self.w2 = linear(hidden, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, attn, mlp):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(), attn()
        self.mlp_norm, self.mlp = RMSNorm(), mlp()

    def forward(self, x, *extra):
        x = x + self.attn(self.attn_norm(x), *extra)
        return x + self.mlp(self.mlp_norm(x))


class LM(nn.Module):
    """Embedding -> LAYERS blocks -> RMSNorm -> LM head; ``layer_inputs`` feeds every block."""

    def __init__(self, attn=Attention, mlp=SwiGLU, block=Block):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(block(attn, mlp) for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.head = nn.Linear(D, VOCAB, bias=False)

    def layer_inputs(self, tokens) -> tuple:
        return ()

    def forward(self, tokens):
        extra = self.layer_inputs(tokens)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, *extra)
        return self.head(self.norm(x))


def rope_angles(dim: int, max_seq: int = MAX_SEQ, base: float = 10000.0):
    """(max_seq, dim // 2) angles position * base^(-2i/dim)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    return torch.outer(torch.arange(max_seq).float(), inv_freq)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


# ----------------------------------------------------------------- positions

class RotateHalfRoPE(Attention):
    """Hugging Face Llama: cos / sin tables of the doubled angles, q*cos + rotate_half(q)*sin."""

    def __init__(self):
        super().__init__()
        emb = torch.cat((rope_angles(self.head_dim),) * 2, dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def position(self, q, k):
        T = q.shape[1]
        cos, sin = self.cos[:T].unsqueeze(1), self.sin[:T].unsqueeze(1)  # over heads
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class InterleavedRoPE(Attention):
    """GPT-J: pairs (0, 1), (2, 3)... rotated, tables repeat_interleave'd to head_dim."""

    def __init__(self):
        super().__init__()
        angles = rope_angles(self.head_dim).repeat_interleave(2, dim=-1)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)

    def position(self, q, k):
        T = q.shape[1]
        sin, cos = self.sin[None, :T, None, :], self.cos[None, :T, None, :]
        return (q * cos) + (rotate_every_two(q) * sin), (k * cos) + (rotate_every_two(k) * sin)


class PartialRoPE(Attention):
    """GPT-NeoX: rotary on the first rotary_dim of each head, the rest passed through."""

    def __init__(self, rotary_pct: float = 0.5):
        super().__init__()
        self.rotary_dim = int(self.head_dim * rotary_pct)
        emb = torch.cat((rope_angles(self.rotary_dim),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def position(self, q, k):
        T, rd = q.shape[1], self.rotary_dim
        cos, sin = self.cos_cached[:T, None], self.sin_cached[:T, None]
        q_rot, q_pass = q[..., :rd], q[..., rd:]
        k_rot, k_pass = k[..., :rd], k[..., rd:]
        q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        return q, k


class TorchtitanAttention(Attention):
    """torchtitan Llama 3: complex RoPE, heads inferred with -1, SDPA with enable_gqa."""

    def __init__(self):
        super().__init__(n_heads=8, n_kv_heads=2)
        angles = rope_angles(self.head_dim)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def project(self, x):
        bs, seqlen, _ = x.shape
        return (self.wq(x).view(bs, seqlen, -1, self.head_dim),
                self.wk(x).view(bs, seqlen, -1, self.head_dim),
                self.wv(x).view(bs, seqlen, -1, self.head_dim))

    def position(self, xq, xk):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = self.freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    def attend(self, q, k, v, *extra):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class PairStackRoPE(Attention):
    """Pairs by reshape(..., -1, 2), rotated, re-interleaved by stack(..., -1).flatten(3)."""

    def __init__(self):
        super().__init__()
        angles = rope_angles(self.head_dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def position(self, q, k):
        cos, sin = self.cos[: q.shape[1], None], self.sin[: q.shape[1], None]

        def rotate(x):
            x = x.reshape(*x.shape[:-1], -1, 2)
            x1, x2 = x[..., 0], x[..., 1]
            return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(3)

        return rotate(q), rotate(k)


class ALiBiAttention(Attention):
    """BLOOM / MPT: no rotary; a per-head linear distance penalty added to the scores."""

    def __init__(self):
        super().__init__()
        slopes = torch.tensor([2 ** (-8 * (i + 1) / self.n_heads) for i in range(self.n_heads)])
        self.register_buffer("slopes", slopes.view(self.n_heads, 1, 1), persistent=False)

    def attend(self, q, k, v, *extra):
        T = q.shape[2]
        pos = torch.arange(T, device=q.device)
        bias = self.slopes * (pos[None, :] - pos[:, None]).float()  # (heads, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + bias
        scores = scores.masked_fill(causal, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class T5RelativeBias(Attention):
    """T5 / CPM-Ant: a learned (buckets, heads) ``nn.Embedding`` looked up by bucketed
    relative position, permuted to (heads, T, T) and added to the explicit scores."""

    BUCKETS = 16

    def __init__(self):
        super().__init__()
        self.relative_bias = nn.Embedding(self.BUCKETS, self.n_heads)

    def attend(self, q, k, v, *extra):
        T = q.shape[2]
        pos = torch.arange(T, device=q.device)
        distance = (pos[:, None] - pos[None, :]).clamp(0, self.BUCKETS - 1)  # causal: >= 0
        bias = self.relative_bias(distance).permute(2, 0, 1)  # (heads, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + bias
        scores = scores.masked_fill(causal, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


# ----------------------------------------------------------------- projections

class FusedQKV(Attention):
    """One Linear(D, 3D) viewed as (B, T, 3, heads, head_dim) and unbound (x-transformers)."""

    def init_projections(self, linear):
        self.wqkv = linear(D, 3 * D, bias=False)
        self.wo = linear(D, D, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        return self.wqkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)


class TimmQKV(Attention):
    """timm / DiT / OpenCLIP: reshape(B, T, 3, heads, head_dim).permute(2, 0, 3, 1, 4), then
    unbind(0) into (B, heads, T, head_dim) q, k, v."""

    def init_projections(self, linear):
        FusedQKV.init_projections(self, linear)

    def forward(self, x, *extra):
        B, T, _ = x.shape
        qkv = self.wqkv(x).reshape(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        return self.output(self.attend(q, k, v).transpose(1, 2))


class FusedMQA(Attention):
    """GPT-BigCode: one c_attn Linear(D, D + 2 * head_dim) for 8 query heads and ONE kv head,
    split into q and k / v, the kv head expanded to the query heads."""

    def init_projections(self, linear):
        self.wqkv = linear(D, D + 2 * self.head_dim, bias=False)
        self.wo = linear(D, D, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([D, self.head_dim, self.head_dim], dim=-1)
        k, v = (t.view(B, T, 1, self.head_dim).expand(B, T, self.n_heads, self.head_dim)
                for t in (k, v))
        return q.view(B, T, self.n_heads, self.head_dim), k, v


class IndexedMQA(Attention):
    """Falcon-7B: one query_key_value Linear viewed per head as (B, T, heads + 2, head_dim),
    its one key and one value head picked by list indices (``qkv[..., [-2], :]``, advanced
    indexing), broadcast to the query heads inside SDPA."""

    def __init__(self):
        super().__init__(n_kv_heads=1)

    def init_projections(self, linear):
        self.wqkv = linear(D, D + 2 * self.head_dim, bias=False)
        self.wo = linear(D, D, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, self.n_heads + 2, self.head_dim)
        return qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]


class SlicedQKV(Attention):
    """Phi-3: one qkv_proj for 8 query and 4 kv heads, cut at head offsets by slices
    (``qkv[..., :query_pos]``), so the q, k and v chunks have different sizes."""

    def __init__(self):
        super().__init__(n_kv_heads=4)

    def init_projections(self, linear):
        self.wqkv = linear(D, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        self.wo = linear(D, D, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        qkv = self.wqkv(x)
        q_pos, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv[..., :q_pos], qkv[..., q_pos:q_pos + kv], qkv[..., q_pos + kv:]
        return (q.view(B, T, self.n_heads, self.head_dim), k.view(B, T, -1, self.head_dim),
                v.view(B, T, -1, self.head_dim))

    def attend(self, q, k, v, *extra):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class EinsumAttention(Attention):
    """Flax / Gemma ports: (D, heads, head_dim) Parameters and einsum projections."""

    def init_projections(self, linear):
        def param(*shape, fan_in=D):
            return nn.Parameter(torch.randn(*shape) / math.sqrt(fan_in))

        self.wq, self.wk, self.wv = (param(D, self.n_heads, self.head_dim) for _ in range(3))
        self.wo = param(self.n_heads, self.head_dim, D)

    def project(self, x):
        return tuple(torch.einsum("bld,dhk->blhk", x, w) for w in (self.wq, self.wk, self.wv))

    def output(self, y):
        return torch.einsum("blhk,hkd->bld", y, self.wo)


class WholeQKNorm(Attention):
    """OLMo 2 / OLMoE: RMSNorm over the whole q and k projections (every head at once), before
    the head split. Its mean of squares spans the heads the ranks split: each rank's sum of
    squares over its heads, all-reduced (one number per token), not a gather of the projection."""

    def init_projections(self, linear):
        super().init_projections(linear)
        self.q_norm = RMSNorm(self.n_heads * self.head_dim)
        self.k_norm = RMSNorm(self.n_kv_heads * self.head_dim)

    def project(self, x):
        B, T, _ = x.shape
        return (self.q_norm(self.wq(x)).view(B, T, self.n_heads, self.head_dim),
                self.k_norm(self.wk(x)).view(B, T, self.n_kv_heads, self.head_dim),
                self.wv(x).view(B, T, self.n_kv_heads, self.head_dim))


class NormalizedQK(Attention):
    """nGPT / cosine attention (Swin v2, some ViTs): q and k unit-normalised per head with
    ``F.normalize(x, dim=-1)`` (``linalg_vector_norm`` over head_dim), then scaled by nGPT's
    ``sqk`` over all the heads' features, viewed per head. The heads are cut, head_dim is
    whole: each rank normalises its own heads."""

    def init_projections(self, linear):
        super().init_projections(linear)
        self.sqk = nn.Parameter(torch.full((D,), math.sqrt(self.head_dim)))

    def position(self, q, k):
        sqk = self.sqk.view(1, 1, self.n_heads, self.head_dim)
        return F.normalize(q, dim=-1) * sqk, F.normalize(k, dim=-1) * sqk


class FullPrecisionQKNorm(Attention):
    """Gemma / Qwen-style per-head q and k RMSNorms run in float32 with autocast switched off
    (``torch.autocast(..., enabled=False)``, as Hugging Face does around RoPE): export captures
    the region as a ``wrap_with_autocast`` call of a submodule."""

    def init_projections(self, linear):
        super().init_projections(linear)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)

    def position(self, q, k):
        with torch.autocast(q.device.type, enabled=False):
            return self.q_norm(q.float()).type_as(q), self.k_norm(k.float()).type_as(k)


class MatmulLinear(nn.Linear):
    """A Linear that spells out its matmul, as LoRA / quantization wrappers do."""

    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


# ----------------------------------------------------------------- heads and attention

class RepeatKV(Attention):
    """Hugging Face repeat_kv: k[:, :, None].expand(...).reshape(...) to the query heads."""

    def attend(self, q, k, v, *extra):
        B, n_kv, T, hd = k.shape
        n_rep = self.n_heads // n_kv
        k = k[:, :, None, :, :].expand(B, n_kv, n_rep, T, hd).reshape(B, n_kv * n_rep, T, hd)
        v = v[:, :, None, :, :].expand(B, n_kv, n_rep, T, hd).reshape(B, n_kv * n_rep, T, hd)
        return super().attend(q, k, v)


class RepeatInterleaveKV(Attention):
    """GQA by torch.repeat_interleave on the head dim (Mistral reference, many forks)."""

    def attend(self, q, k, v, *extra):
        n_rep = self.n_heads // self.n_kv_heads
        k = torch.repeat_interleave(k, repeats=n_rep, dim=1)
        v = torch.repeat_interleave(v, repeats=n_rep, dim=1)
        return super().attend(q, k, v)


class MaskedSoftmax(Attention):
    """nanoGPT: softmax(q k^T / sqrt(d)) with a tril buffer and masked_fill, then @ v."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ))
                             .view(1, 1, MAX_SEQ, MAX_SEQ), persistent=False)

    def attend(self, q, k, v, *extra):
        T = q.size(2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class BatchHeadsBmm(Attention):
    """BART / XGLM / fairseq: batch and heads merged into one dim, ``reshape(B * H, T, d)``,
    attention by ``bmm``, the causal mask added as ``view(B, H, T, T) + mask``, then back."""

    def attend(self, q, k, v, *extra):
        B, H, T, d = q.shape
        q, k, v = (t.reshape(B * H, T, d) for t in (q * d ** -0.5, k, v))
        scores = torch.bmm(q, k.transpose(1, 2))
        mask = torch.full((T, T), float("-inf"), device=q.device).triu(1)
        scores = (scores.view(B, H, T, T) + mask).view(B * H, T, T)
        return torch.bmm(F.softmax(scores, dim=-1), v).view(B, H, T, d)


class PaddingMaskLM(LM):
    """Hugging Face: a (B, 1, T, T) boolean mask (causal and not padding) made once per call."""

    PAD = 0

    def layer_inputs(self, tokens):
        B, T = tokens.shape
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        keep = (tokens != self.PAD)[:, None, None, :] & causal
        return (keep | torch.eye(T, dtype=torch.bool, device=tokens.device),)  # no empty rows


class MaskedSDPA(Attention):
    def attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class SelectiveScan(nn.Module):
    """Mamba in the attention's place: in_proj to (x, z), a depthwise causal ``conv1d`` over
    channels, ``x_proj`` split into (dt, B, C), ``dt_proj``, the selective scan, gated,
    ``out_proj``. The scan is the masked segment-sum form of Mamba-2's ``ssd_minimal``
    (``exp(cumsum)`` differences under a causal mask) rather than a loop over time steps
    (Hugging Face's reference path), so sizes stay dynamic."""

    def __init__(self, d_inner: int = HIDDEN, d_state: int = 8, dt_rank: int = 8, kernel: int = 4):
        super().__init__()
        self.in_proj = nn.Linear(D, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, kernel, groups=d_inner, padding=kernel - 1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1).float()).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, D, bias=False)
        self.sizes = [dt_rank, d_state, d_state]

    def forward(self, hidden):
        T = hidden.shape[1]
        x, z = self.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)  # (B, d_inner, T) each
        x = F.silu(self.conv1d(x)[..., :T])
        dt, b, c = torch.split(self.x_proj(x.transpose(1, 2)), self.sizes, dim=-1)
        dt = F.softplus(self.dt_proj(dt)).transpose(1, 2)  # (B, d_inner, T)
        log_decay = (-torch.exp(self.A_log))[None, :, None, :] * dt[..., None]  # (B, d, T, n)
        cum = torch.cumsum(log_decay, dim=2)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        gaps = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(~causal[:, :, None], -math.inf)
        states = torch.einsum("bdtsn,bdsn->bdtn", gaps.exp(), (dt * x)[..., None] * b[:, None])
        y = torch.einsum("bdtn,btn->bdt", states, c) + x * self.D[None, :, None]
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


class Mamba2Mixer(nn.Module):
    """Mamba-2 in the attention's place, as transformers' Bamba / Zamba2 / Falcon-H1 write it:
    one in_proj to (z, xBC, dt), a depthwise causal ``conv1d`` over xBC, split into x (heads x
    head_dim) and B, C of ONE group every head reads (``repeat_interleave`` to the heads), the
    SSD scan in its quadratic form (``C . B`` under each head's decay mask), a gated RMSNorm
    over all of d_inner, out_proj."""

    def __init__(self, d_inner: int = HIDDEN, n_heads: int = HEADS, d_state: int = 16,
                 kernel: int = 4):
        super().__init__()
        self.sizes = [d_inner, d_inner + 2 * d_state, n_heads]
        self.in_proj = nn.Linear(D, sum(self.sizes), bias=False)
        conv = self.sizes[1]
        self.conv1d = nn.Conv1d(conv, conv, kernel, groups=conv, padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.linspace(-2.0, -1.0, n_heads))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 2.0, n_heads)))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = RMSNorm(d_inner)
        self.out_proj = nn.Linear(d_inner, D, bias=False)
        self.d_inner, self.n_heads, self.d_state = d_inner, n_heads, d_state

    def forward(self, hidden):
        B, T, _ = hidden.shape
        z, xbc, dt = self.in_proj(hidden).split(self.sizes, dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :T]).transpose(1, 2)
        x, b, c = torch.split(xbc, [self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.view(B, T, self.n_heads, -1)
        b, c = (t.view(B, T, 1, self.d_state).repeat_interleave(self.n_heads, dim=2,
                                                                 output_size=self.n_heads)
                for t in (b, c))
        dt = F.softplus(dt + self.dt_bias)  # (B, T, heads)
        cum = torch.cumsum(-torch.exp(self.A_log) * dt, dim=1)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        decay = (cum[:, :, None] - cum[:, None]).masked_fill(~causal[..., None], -math.inf).exp()
        scores = torch.einsum("bthn,bshn->btsh", c, b) * decay
        y = torch.einsum("btsh,bshp->bthp", scores, x * dt[..., None]) + x * self.D[:, None]
        return self.out_proj(self.norm(y.reshape(B, T, -1) * F.silu(z)))


# ----------------------------------------------------------------- MLPs

class RawParamSwiGLU(nn.Module):
    """(in, out) Parameters used with @ and einsum, no nn.Linear (JAX ports, minGPT forks)."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(D, hidden) / math.sqrt(D))
        self.w_up = nn.Parameter(torch.randn(D, hidden) / math.sqrt(D))
        self.w_down = nn.Parameter(torch.randn(hidden, D) / math.sqrt(hidden))

    def forward(self, x):
        gate = F.silu(x @ self.w_gate)
        up = torch.einsum("btd,dh->bth", x, self.w_up)
        return (gate * up) @ self.w_down


class ReluSquaredMLP(nn.Module):
    """Primer / NanoChat / Nemotron-H / Persimmon: ``w2(square(relu(w1 x)))``. ``torch.square``
    has no entry in the rule table: torch tags it pointwise, which is rule enough."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, hidden, bias=False), nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        return self.w2(torch.square(F.relu(self.w1(x))))


class NormalizedSwiGLU(SwiGLU):
    """A SwiGLU whose hidden activation is unit-normalised over its features before the down
    projection (``F.normalize(h, dim=-1)``, nGPT-style), scaled per feature: the norm spans
    the hidden features the ranks split, so its sum of squares is a per-token statistic."""

    def __init__(self, hidden: int = HIDDEN, linear=nn.Linear):
        super().__init__(hidden, linear)
        self.gain = nn.Parameter(torch.full((hidden,), math.sqrt(hidden)))

    def forward(self, x):
        return self.w2(F.normalize(F.silu(self.w1(x)) * self.w3(x), dim=-1) * self.gain)


class FusedGateUp(nn.Module):
    """Phi-3 / vLLM: one gate_up Linear(D, 2 * hidden), chunked in two."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.gate_up_proj = nn.Linear(D, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class InterleavedGateUp(FusedGateUp):
    """gpt-oss: one gate_up projection whose gate and up features alternate, taken apart by
    strided slices ``h[..., ::2]`` and ``h[..., 1::2]``."""

    def forward(self, x):
        h = self.gate_up_proj(x)
        return self.down_proj(F.silu(h[..., ::2]) * h[..., 1::2])


class ModuleListMoE(nn.Module):
    """Mixtral: softmax router, top-2, a loop over experts gathering their tokens by index."""

    def __init__(self, n_experts: int = 4, top_k: int = 2, hidden: int = 64):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(D, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden) for _ in range(n_experts))

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs = F.softmax(self.router(flat), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            y = expert(flat.index_select(0, token)) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view(B, T, C)


class StackedMoE(nn.Module):
    """Stacked (experts, out, in) weights applied to every token by bmm, gated densely
    (GShard / dense-dispatch style): no data-dependent shapes."""

    def __init__(self, n_experts: int = 4, top_k: int = 2, hidden: int = 64):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(D, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, D) / math.sqrt(D))
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, D) / math.sqrt(D))
        self.w2 = nn.Parameter(torch.randn(n_experts, D, hidden) / math.sqrt(hidden))

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        weights, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        gates = torch.zeros_like(flat[:, : self.n_experts]).scatter(-1, chosen, weights)
        xs = flat.unsqueeze(0).expand(self.n_experts, -1, -1)  # (experts, tokens, D)
        h = F.silu(torch.bmm(xs, self.w1.transpose(1, 2))) * torch.bmm(xs, self.w3.transpose(1, 2))
        y = torch.bmm(h, self.w2.transpose(1, 2))  # (experts, tokens, D)
        return (gates.t().unsqueeze(-1) * y).sum(0).view(B, T, C)


class ScaledTokensMoE(nn.Module):
    """Llama 4: every token repeated per expert and scaled by its sigmoid routing score before
    stacked ``(experts, in, out)`` experts (one fused gate_up, bmm), plus a shared expert that
    reads the unscaled tokens."""

    def __init__(self, n_experts: int = 4, top_k: int = 1, hidden: int = 64):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(D, n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(n_experts, D, 2 * hidden) / math.sqrt(D))
        self.down = nn.Parameter(torch.randn(n_experts, hidden, D) / math.sqrt(hidden))
        self.shared = SwiGLU(hidden)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        logits = self.router(flat)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter(1, chosen, top)
        scores = torch.sigmoid(scores.transpose(0, 1))  # (experts, tokens)
        routed = (flat.repeat(self.n_experts, 1) * scores.reshape(-1, 1)).view(self.n_experts, -1, C)
        gate, up = torch.bmm(routed, self.gate_up).chunk(2, dim=-1)
        y = torch.bmm(up * F.silu(gate), self.down)
        return (self.shared(flat) + y.sum(0)).view(B, T, C)


PER_LAYER = 32


class PerLayerInputBlock(Block):
    """A block that ends by gating a projection of its stream with its own per-layer input."""

    def __init__(self, attn, mlp):
        super().__init__(attn, mlp)
        self.gate = nn.Linear(D, PER_LAYER, bias=False)
        self.project = nn.Linear(PER_LAYER, D, bias=False)

    def forward(self, x, per_layer_input):
        x = super().forward(x)
        return x + self.project(F.gelu(self.gate(x)) * per_layer_input)


class PerLayerInputLM(LM):
    """Gemma 3n / Gemma 4 per-layer inputs: one (B, T, layers, P) tensor made before the blocks
    (its own embedding plus a normalised projection of the token embeddings), block i reading
    ``inputs[:, :, i, :]``."""

    def __init__(self):
        super().__init__(block=PerLayerInputBlock)
        self.embed_per_layer = nn.Embedding(VOCAB, LAYERS * PER_LAYER)
        self.per_layer_proj = nn.Linear(D, LAYERS * PER_LAYER, bias=False)
        self.per_layer_norm = RMSNorm(PER_LAYER)

    def forward(self, tokens):
        B, T = tokens.shape
        x = self.embed(tokens)
        made = self.per_layer_norm(self.per_layer_proj(x).view(B, T, LAYERS, PER_LAYER))
        inputs = (made + self.embed_per_layer(tokens).view(B, T, LAYERS, PER_LAYER)) * 2 ** -0.5
        for i, layer in enumerate(self.layers):
            x = layer(x, inputs[:, :, i, :])
        return self.head(self.norm(x))


# ----------------------------------------------------------------- the registry

MOE_EXPERTS = _in_layers("mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"), \
    _in_layers("mlp.experts.*.w2.weight")
_KV = _in_layers("attn.wk.weight", "attn.wv.weight")
# Experts sharded like SwiGLUs, their partial outputs weighted and summed, then ONE forward
# all-reduce. Backward: ONE too. The routing weights' gradient, <expert output, grad> over
# partial outputs, is a partial sum as well; the routing weights are computed from the block's
# input (not from a consumer of its synced copy), so both share one all-reduce.
MOE = dict(replicated=BASELINE.replicated + _in_layers("mlp.router.weight"))
_REGISTRY = [
    # name, factory, expected plan
    ("rope_rotate_half", lambda: LM(attn=RotateHalfRoPE), BASELINE),
    ("rope_gptj_interleaved", lambda: LM(attn=InterleavedRoPE), BASELINE),
    ("rope_neox_partial", lambda: LM(attn=PartialRoPE), BASELINE),
    ("torchtitan_llama3", lambda: LM(attn=TorchtitanAttention),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=2)),
    ("rope_pair_stack", lambda: LM(attn=PairStackRoPE), BASELINE),
    ("alibi", lambda: LM(attn=ALiBiAttention), BASELINE),
    ("fused_qkv_unbind", lambda: LM(attn=FusedQKV),
     attention_expect(col=_in_layers("attn.wqkv.weight"))),  # per q / k / v chunk
    ("fused_qkv_timm", lambda: LM(attn=TimmQKV), attention_expect(col=_in_layers("attn.wqkv.weight"))),
    ("fused_qkv_slices", lambda: LM(attn=SlicedQKV), attention_expect(col=_in_layers("attn.wqkv.weight"))),
    # q's rows cut by heads, the kv head's rows whole on every rank (its gradient all-reduced
    # once: backward +1), as a separate k / v projection of one head is
    ("fused_qkv_mqa", lambda: LM(attn=FusedMQA),
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
    ("gqa_expand_reshape", lambda: LM(attn=partial(RepeatKV, n_kv_heads=4)),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=4)),
    ("gqa_repeat_interleave", lambda: LM(attn=partial(RepeatInterleaveKV, n_kv_heads=4)),
     attention_expect(col=_in_layers("attn.wq.weight"), kv=_KV, kv_heads=4)),
    ("softmax_masked_fill", lambda: LM(attn=MaskedSoftmax), BASELINE),
    ("bmm_batch_heads_merged", lambda: LM(attn=BatchHeadsBmm), BASELINE),
    # the norms' weights are cut with the features they scale; per norm one forward all-reduce
    # of its statistic, and backward one for both (each statistic's gradient sums over the cut
    # features; the two are bucketed)
    ("qk_norm_whole", lambda: LM(attn=WholeQKNorm),
     attention_expect(col=ATTN_COL + _in_layers("attn.q_norm.weight", "attn.k_norm.weight"),
                      fwd_allreduce_per_layer=4, bwd_allreduce_per_layer=3)),
    ("swiglu_linear", lambda: LM(), BASELINE),
    # unit-norm q / k per head: head_dim is whole on every rank, nothing to reduce; sqk, read
    # by q and k through one view, is whole on every rank, its gradient synced in the
    # attention input's all-reduce
    ("qk_normalize_per_head", lambda: LM(attn=NormalizedQK),
     attention_expect(replicated=BASELINE.replicated + _in_layers("attn.sqk"))),
    # the per-head norms' weights are whole on every rank (as Megatron's q / k layernorms):
    # their gradients are all-reduced once (backward +1)
    ("qk_norm_autocast_off", lambda: LM(attn=FullPrecisionQKNorm),
     attention_expect(replicated=BASELINE.replicated + _in_layers("attn.q_norm.weight",
                                                                  "attn.k_norm.weight"),
                      bwd_allreduce_per_layer=3)),
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
    ("mlp_relu_squared", lambda: LM(mlp=ReluSquaredMLP),
     mlp_expect(col=_in_layers("mlp.w1.weight"))),
    # the gain cut with the hidden features; the norm's sum of squares all-reduced forward
    # (+1), its gradient backward (+1)
    ("mlp_normalize_hidden", lambda: LM(mlp=NormalizedSwiGLU),
     mlp_expect(col=MLP_COL + _in_layers("mlp.gain"), fwd_allreduce_per_layer=3,
                bwd_allreduce_per_layer=3)),
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
    ("moe_stacked_bmm", lambda: LM(mlp=StackedMoE),
     mlp_expect(col=_in_layers("mlp.w1", "mlp.w3"), row=_in_layers("mlp.w2"), **MOE)),
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
]
# what each idiom writes its own way, for the support table bench/idioms.py generates
STYLES = {
    "rope_rotate_half": "HF Llama RoPE: `q * cos + rotate_half(q) * sin`",
    "rope_gptj_interleaved": "GPT-J RoPE on pairs `x[..., 0::2]`, `x[..., 1::2]`, `stack(..., -1).flatten(-2)`",
    "rope_neox_partial": "GPT-NeoX partial rotary: `cat(rotated q[..., :rd], q[..., rd:])`",
    "torchtitan_llama3": "torchtitan Llama 3: `view_as_complex` RoPE, `view(bs, T, -1, hd)`, SDPA `enable_gqa`, 8 q / 2 kv heads",
    "rope_pair_stack": "RoPE by `reshape(..., -1, 2)`, `stack([...], -1).flatten(3)`",
    "alibi": "BLOOM / MPT ALiBi: per-head distance biases added to explicit scores",
    "fused_qkv_unbind": "one qkv Linear, `view(B, T, 3, H, D).unbind(2)`",
    "fused_qkv_timm": "timm / DiT: `reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`",
    "fused_qkv_slices": "Phi-3 `qkv_proj` cut by uneven slices `qkv[..., :q_pos]` (8 q / 4 kv heads)",
    "fused_qkv_mqa": "GPT-BigCode: one `c_attn` for 8 q heads and 1 kv head, `split`, kv `expand`ed",
    "t5_relative_bias": "T5 / CPM-Ant: `nn.Embedding(buckets, heads)` of relative positions added to the scores",
    "fused_qkv_mqa_indexed": "Falcon-7B: `qkv.view(B, T, H + 2, D)`, k / v picked by list indices `qkv[..., [-2], :]`",
    "einsum_qkv_3d": "Flax / Gemma ports: `einsum(\"bld,dhk->blhk\")` with 3-D weights",
    "mqa": "multi-query (1 kv head), HF `repeat_kv` by expand + reshape",
    "gqa_expand_reshape": "GQA 8 q / 4 kv heads, HF `repeat_kv` by expand + reshape",
    "gqa_repeat_interleave": "GQA 8 q / 4 kv heads by `repeat_interleave` on the head dim",
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
    "mlp_relu_squared": "ReLU² MLP: `square(relu(w1 x))`",
    "swiglu_fused_gate_up": "one `gate_up_proj` Linear, `chunk(2, -1)`",
    "swiglu_interleaved_gate_up": "gpt-oss: gate and up features alternate, `h[..., ::2]`, `h[..., 1::2]`",
    "linear_subclass_matmul": "a Linear subclass computing `x @ self.weight.T`",
    "moe_modulelist_top2": "Mixtral loop over a ModuleList of experts: `index_select`, `index_add_`",
    "moe_stacked_bmm": "stacked `(experts, out, in)` expert weights through `bmm`, dense gating",
    "moe_scaled_tokens": "Llama 4: tokens `repeat`ed per expert times sigmoid scores, stacked `(experts, in, out)` gate_up through `bmm`, a shared expert",
    "per_layer_inputs": "Gemma 3n / 4 per-layer inputs: a `(B, T, layers, P)` tensor made before the blocks, block i gated by `inputs[:, :, i, :]`",
    "sdpa_padding_mask": "HF-style `(B, 1, T, T)` boolean padding + causal mask into SDPA",
    "mqa_sdpa_broadcast": "Falcon: 1 kv head broadcast inside SDPA",
}
IDIOMS = {name: factory for name, factory, _ in _REGISTRY}
EXPECT = {name: expect for name, _, expect in _REGISTRY}


def build(name: str, seed: int = 0) -> nn.Module:
    """Idiom ``name`` with deterministic weights."""
    torch.manual_seed(seed)
    return IDIOMS[name]()


def example_inputs(batch: int = 2, seq: int = 16, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, seq), generator=g),)
