"""Decoders that own a static KV cache, written as gpt-fast writes them.

The cache is a pair of buffers per attention block, ``(max_batch, kv_heads, max_seq, head_dim)``
(or ``(max_batch, max_seq, kv_heads, head_dim)`` with ``seq_major=True``), written in place at
the positions ``input_pos`` (a tensor) by slice assignment; attention then reads the whole cache
under a causal mask indexed by those positions. One module serves the prefill call (``T``
prompt tokens) and the decode calls (one token each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StaticKVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, max_seq: int, head_dim: int, seq_major: bool):
        super().__init__()
        self.seq_major = seq_major
        shape = (batch, max_seq, kv_heads, head_dim) if seq_major else (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, input_pos, k, v):
        """k, v: (B, kv_heads, T, head_dim); returns the cache of the call's batch rows."""
        b = k.shape[0]
        k_out, v_out = self.k_cache[:b], self.v_cache[:b]
        if self.seq_major:
            k_out[:, input_pos] = k.transpose(1, 2)
            v_out[:, input_pos] = v.transpose(1, 2)
            return k_out.transpose(1, 2), v_out.transpose(1, 2)
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        return k_out, v_out


class CachedAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, batch, max_seq, seq_major):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = StaticKVCache(batch, kv_heads, max_seq, self.head_dim, seq_major)

    def forward(self, x, input_pos, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, batch, max_seq, seq_major):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = CachedAttention(dim, heads, kv_heads, batch, max_seq, seq_major)
        self.mlp_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w3 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x, input_pos, mask):
        x = x + self.attn(self.attn_norm(x), input_pos, mask)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class CachedDecoder(nn.Module):
    """``forward(idx (B, T), input_pos (T,)) -> logits (B, T, vocab)``, writing the cache."""

    def __init__(self, vocab=256, dim=64, heads=4, kv_heads=2, layers=2, batch=2, max_seq=32,
                 seq_major=False, plain_mask=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, batch, max_seq, seq_major)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        causal = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool))
        if plain_mask:  # a plain tensor attribute, as gpt-fast's setup_caches keeps causal_mask
            self.causal = causal
        else:
            self.register_buffer("causal", causal, persistent=False)

    def forward(self, idx, input_pos):
        x = self.tok(idx)  # no position table: the causal mask orders tokens
        mask = self.causal[input_pos][None, None]
        for block in self.blocks:
            x = block(x, input_pos, mask)
        return self.head(self.norm(x))


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Prefill with ``prompt`` (B, T), then decode ``new_tokens`` one at a time: (B, new_tokens)."""
    t = prompt.shape[1]
    logits = model(prompt, torch.arange(t))
    out = [logits[:, -1].argmax(-1)]
    for i in range(new_tokens - 1):
        logits = model(out[-1][:, None], torch.tensor([t + i]))
        out.append(logits[:, -1].argmax(-1))
    return torch.stack(out, 1)
