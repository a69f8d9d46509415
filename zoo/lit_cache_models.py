"""A decoder that owns its KV cache the way litgpt's ``GPT`` does (litgpt is no test dependency).

What differs from gpt-fast's layout (:mod:`zoo.cache_models`), each a way the capture of a
one-token decode call once failed or planned less:

- the causal mask (``mask_cache``) and the rotary tables (``cos``, ``sin``) are plain tensor
  attributes, neither parameters nor buffers: export reads them as graph constants;
- the cache is a module of its own (litgpt's ``KVCache``) whose buffers ``k`` and ``v`` are
  written by ``self.k[:b, ...].index_copy_(-2, input_pos, k)``; export writes the slice of the
  full batch as ``aten.alias``;
- ``set_kv_cache(batch, max_seq)`` builds the caches and the mask after construction, and
  ``forward(idx, input_pos)`` reads the rotary tables and the mask at ``input_pos``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, max_seq: int, head_dim: int):
        super().__init__()
        shape = (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape), persistent=False)
        self.register_buffer("v", torch.zeros(shape), persistent=False)

    def forward(self, input_pos, k, v):
        b = k.size(0)
        return (self.k[:b, ...].index_copy_(-2, input_pos, k),
                self.v[:b, ...].index_copy_(-2, input_pos, v))


def _rotate(x, cos, sin):
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim,
                                     self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)
        q = _rotate(q.view(b, t, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_cache(input_pos, k, v)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.norm_1, self.norm_2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.attn(self.norm_1(x), cos, sin, mask, input_pos)
        return x + self.out(F.silu(self.fc(self.norm_2(x))))


class LitCachedDecoder(nn.Module):
    """``forward(idx (B, T), input_pos (T,)) -> logits (B, T, vocab)``, after ``set_kv_cache``."""

    def __init__(self, vocab=256, dim=64, heads=4, kv_heads=2, layers=2, max_seq=32):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        angles = torch.outer(torch.arange(max_seq).float(),
                             10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.cat((angles, angles), dim=-1)
        self.cos, self.sin = angles.cos(), angles.sin()  # plain attributes, as litgpt rebinds them
        self.mask_cache: torch.Tensor | None = None
        self.max_seq = max_seq

    def set_kv_cache(self, batch: int) -> None:
        """litgpt's ``GPT.set_kv_cache``: a cache module per block and the causal mask."""
        for block in self.blocks:
            a = block.attn
            block.attn.kv_cache = KVCache(batch, a.kv_heads, self.max_seq, a.head_dim)
        self.mask_cache = torch.tril(torch.ones(self.max_seq, self.max_seq, dtype=torch.bool))[None, None]

    def forward(self, idx, input_pos):
        cos, sin = self.cos.index_select(0, input_pos), self.sin.index_select(0, input_pos)
        mask = self.mask_cache.index_select(2, input_pos)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, cos, sin, mask, input_pos)
        return self.lm_head(self.norm(x))
