"""The idioms' shared skeleton: the baseline block every idiom changes one step of.

Token embedding -> ``LAYERS`` pre-norm blocks -> RMSNorm -> LM head (dim ``D``, ``HEADS`` heads,
SwiGLU hidden ``HIDDEN``, vocabulary ``VOCAB``). ``Attention`` has separate q/k/v/o Linears and
causal SDPA with no positions, ``SwiGLU`` three Linears; an idiom overrides one of their steps,
so a model that misses its Megatron bound points at its idiom.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS, HIDDEN, VOCAB, LAYERS, MAX_SEQ = 64, 8, 128, 256, 2, 64
HEAD_DIM = D // HEADS


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
    """Embedding -> LAYERS blocks -> RMSNorm -> LM head; ``layer_inputs`` feeds every block
    (made from the tokens and whatever else the caller passes)."""

    def __init__(self, attn=Attention, mlp=SwiGLU, block=Block):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(block(attn, mlp) for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.head = nn.Linear(D, VOCAB, bias=False)

    def layer_inputs(self, tokens, *rest) -> tuple:
        return ()

    def forward(self, tokens, *rest):
        extra = self.layer_inputs(tokens, *rest)
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
