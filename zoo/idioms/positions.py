"""Position idioms: RoPE as Llama, GPT-J, GPT-NeoX, torchtitan and others write it, ALiBi and
T5's relative bias, each an ``Attention`` whose ``position`` or ``attend`` step is that code
base's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.idioms.attention import RepeatTiledKV
from zoo.idioms.skeleton import HEADS, D, Attention, rope_angles, rotate_half


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


def rotate_unbound_pairs(x):
    """x-transformers' rotate_half: the pairs split off by a view and ``unbind(-1)``."""
    x1, x2 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class InterleavedRoPE(Attention):
    """GPT-J: pairs (0, 1), (2, 3)... rotated, tables repeat_interleave'd to head_dim."""

    rotate = staticmethod(rotate_every_two)

    def __init__(self, n_kv_heads: int | None = None):
        super().__init__(n_kv_heads=n_kv_heads)
        angles = rope_angles(self.head_dim).repeat_interleave(2, dim=-1)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)

    def position(self, q, k):
        T = q.shape[1]
        sin, cos = self.sin[None, :T, None, :], self.cos[None, :T, None, :]
        return (q * cos) + (self.rotate(q) * sin), (k * cos) + (self.rotate(k) * sin)


class UnboundPairsGQA(InterleavedRoPE, RepeatTiledKV):
    """x-transformers: RoPE's pairs by ``unbind(-1)``, 8 q / 2 kv heads tiled to the queries:
    at 4 ranks every rank holds the kv heads whole, their values go through ``unbind``."""

    rotate = staticmethod(rotate_unbound_pairs)

    def __init__(self):
        super().__init__(n_kv_heads=2)


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


class LatentAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention as torchtitan writes it: q split per head into a
    no-position part and a rotated part, joined back by ``cat``; k's rotated part is one head
    computed from the block's input (``wkv_a``), rotated and ``expand``ed over the heads, then
    ``cat`` to the per-head no-position k from the low-rank ``wkv_b``. Each ``cat`` joins a
    head-sharded tensor with one every rank holds whole."""

    NOPE, ROPE, V, RANK = 8, 8, 8, 8  # wkv_a: D -> 16, a low-rank down factor (<= D / 4)

    def __init__(self):
        super().__init__()
        self.n_heads = HEADS
        self.wq = nn.Linear(D, HEADS * (self.NOPE + self.ROPE), bias=False)
        self.wkv_a = nn.Linear(D, self.RANK + self.ROPE, bias=False)
        self.kv_norm = nn.RMSNorm(self.RANK, eps=1e-6)
        self.wkv_b = nn.Linear(self.RANK, HEADS * (self.NOPE + self.V), bias=False)
        self.wo = nn.Linear(HEADS * self.V, D, bias=False)
        angles = rope_angles(self.ROPE)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def rotate(self, x):
        """torchtitan's ``apply_rotary_emb``: complex pairs, so a shard of the last dim passes
        through the rotation to the ``cat`` (no ``rotate_half`` split to stop it earlier)."""
        x_ = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
        freqs = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
        return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.NOPE + self.ROPE)
        q_nope, q_pe = torch.split(q, [self.NOPE, self.ROPE], dim=-1)
        q = torch.cat([q_nope, self.rotate(q_pe)], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.RANK, self.ROPE], dim=-1)
        k_pe = self.rotate(k_pe.unsqueeze(2))
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.NOPE + self.V)
        k_nope, v = torch.split(kv, [self.NOPE, self.V], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, -1))
