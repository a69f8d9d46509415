"""Projection idioms: fused qkv weights cut by views, slices or indices, einsum over 3-D
weights, q / k norms, and a Linear that multiplies by its own weight: how code bases write the
step from the block's input to q, k and v.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.idioms.skeleton import Attention, D, RMSNorm, rope_angles, rotate_half


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


class RotaryMQA(FusedMQA):
    """litgpt with one query group (Falcon): one qkv Linear split on its features into q and
    ONE k / v head, k / v viewed (B, T, 1, head_dim), RoPE by ``cat((-x2, x1))`` over all of
    head_dim then ``cat((roped, x[..., rope_n_elem:]))`` with nothing left, and the kv head
    ``repeat_interleave``d to the query heads."""

    def __init__(self):
        super().__init__(n_kv_heads=1)
        emb = torch.cat((rope_angles(self.head_dim),) * 2, dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def project(self, x):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([D, self.head_dim, self.head_dim], dim=-1)
        return (q.view(B, T, self.n_heads, self.head_dim), k.view(B, T, 1, self.head_dim),
                v.view(B, T, 1, self.head_dim))

    def position(self, q, k):
        T, n = q.shape[1], self.head_dim  # litgpt's rope_n_elem: all of head_dim
        cos, sin = self.cos[:T].unsqueeze(1), self.sin[:T].unsqueeze(1)  # over heads

        def rope(x):
            roped = x[..., :n] * cos + rotate_half(x[..., :n]) * sin
            return torch.cat((roped, x[..., n:]), dim=-1)
        return rope(q), rope(k)

    def attend(self, q, k, v, *extra):
        k, v = (t.repeat_interleave(self.n_heads, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


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


class SplitWeightQKV(Attention):
    """``nn.MultiheadAttention``'s cross-attention path (``_in_projection_packed`` when the
    query is not the key): the packed ``in_proj_weight`` and bias split into q rows and k / v
    rows *before* two ``F.linear`` calls, the k / v output then taken apart by
    ``unflatten(-1, (2, D))``. Here both read the block's input, as the skeleton has one."""

    def init_projections(self, linear):
        self.in_proj_weight = nn.Parameter(torch.randn(3 * D, D) / math.sqrt(D))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * D) / 10)
        self.wo = linear(D, D, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        w_q, w_kv = self.in_proj_weight.split([D, 2 * D])
        b_q, b_kv = self.in_proj_bias.split([D, 2 * D])
        k, v = F.linear(x, w_kv, b_kv).unflatten(-1, (2, D)).unbind(-2)
        return tuple(t.view(B, T, self.n_heads, self.head_dim)
                     for t in (F.linear(x, w_q, b_q), k, v))


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


class FusedWholeQKNorm(WholeQKNorm):
    """Wan 2.x / diffusers' Wan attention: ``torch.nn.RMSNorm(heads * head_dim)`` on q and k
    (ATen's fused ``rms_norm``, not a module of means), planned through its decomposition."""

    def init_projections(self, linear):
        Attention.init_projections(self, linear)
        self.q_norm = nn.RMSNorm(self.n_heads * self.head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(self.n_kv_heads * self.head_dim, eps=1e-6)


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
    the scope as a ``wrap_with_autocast`` call of a submodule."""

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
