"""Attention blocks written with ``flex_attention``, and their twins written in plain tensor ops.

Each case is one pre-norm attention block whose ``flex_attention`` call reads the head index
in its ``score_mod`` (ALiBi: head ``h`` adds ``-slope(h) * |q - kv|``, ``slope(h) = 2 **
(-8 (h + 1) / H)``), so a rank that saw its local head index would bias its heads like rank
0's. The block mask comes in as a call input (a ``BlockMask``, as torchtitan passes it) or is
built inside ``forward`` by ``create_block_mask``. The slopes may also be a table the
``score_mod`` indexes by the head (``slope_table``): a tensor it closes over, read whole with
the global index. ``math=True`` builds the same block computing the same attention with
explicit scores, softmax and ``masked_fill``: the unsharded reference whose gradients CPU can
compute (torch refuses flex attention's backward on CPU inputs that require grad).

``VarlenBlock`` is one such block on packed sequences through ``torch.nn.attention.varlen``,
whose op torch runs only with CUDA kernels: :func:`register_varlen_math` gives it a CPU one.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

DIM, SEQ, BATCH = 64, 16, 2


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def slope(h, heads: int):
    return torch.exp2(-8.0 * (h + 1) / heads)


class FlexBlock(nn.Module):
    """x + o(attention(norm(x))) with q / k / v / o linears, ``heads`` query heads and
    ``kv_heads`` key / value heads (GQA when fewer)."""

    def __init__(self, heads: int = 8, kv_heads: int = 8, inner_mask: bool = False,
                 slope_table: bool = False, math_impl: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, DIM // heads
        self.inner_mask, self.math_impl = inner_mask, math_impl
        # the slopes as a buffer the score_mod indexes by head (a tensor it closes over)
        self.slopes = slope(torch.arange(heads), heads) if slope_table else None
        self.norm = nn.RMSNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, block_mask=None):
        B, T, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        y = self._math(q, k, v) if self.math_impl else self._flex(q, k, v, block_mask, T)
        return x + self.o(y.transpose(1, 2).reshape(B, T, DIM))

    def _flex(self, q, k, v, block_mask, T):
        heads, slopes = self.heads, self.slopes

        def alibi(score, b, h, q_idx, kv_idx):
            s = slope(h, heads) if slopes is None else slopes[h]
            return score - s * (q_idx - kv_idx).abs()

        if self.inner_mask:
            block_mask = create_block_mask(causal, None, None, T, T, device=q.device)
        return flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask,
                              enable_gqa=self.kv_heads != self.heads)

    def _math(self, q, k, v):
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        T = q.shape[-2]
        pos = torch.arange(T)
        h = torch.arange(self.heads).view(-1, 1, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores - slope(h, self.heads) * (pos.view(-1, 1) - pos).abs()
        scores = scores.masked_fill(~causal(None, None, pos.view(-1, 1), pos), float("-inf"))
        return scores.softmax(-1) @ v


# case -> the block's arguments; the block mask is a call input unless ``inner_mask``
CASES = {
    "flex_alibi": {},
    "flex_alibi_gqa": {"kv_heads": 4},
    "flex_alibi_mqa": {"kv_heads": 2},
    "flex_inner_mask": {"inner_mask": True},
    "flex_slope_table": {"slope_table": True},
}


def local_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 4


def hf_llama(attn_implementation: str):
    """A tiny random-init Llama (hidden 64, 2 layers, 8 heads, 2 kv heads, vocab 128)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                            max_position_embeddings=64)
    config._attn_implementation = attn_implementation
    return tf.LlamaForCausalLM(config)


def torchtitan(kind: str):
    """(model, (tokens,), {"attention_masks": block mask}) of torchtitan 0.3's debug model."""
    import importlib

    registry = importlib.import_module(f"torchtitan.models.{kind}").model_registry
    torch.manual_seed(0)
    model = registry("debugmodel").model.build()
    model.init_states(buffer_device=None)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, 64),
                           generator=torch.Generator().manual_seed(1))
    masks = model.get_attention_masks(torch.arange(64).repeat(BATCH, 1))
    return model, (tokens,), {"attention_masks": masks}


def build(name: str, math_impl: bool = False):
    """(model, example inputs) of case ``name``; the same weights for both implementations."""
    if name == "hf_llama_flex":
        ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        return hf_llama("sdpa" if math_impl else "flex_attention"), (ids,)
    torch.manual_seed(0)
    model = FlexBlock(**CASES[name], math_impl=math_impl)
    x = torch.randn(BATCH, SEQ, DIM)
    if CASES[name].get("inner_mask"):
        return model, (x,)
    return model, (x, create_block_mask(causal, None, None, SEQ, SEQ, device="cpu"))


# ----------------------------------------------------------------- varlen attention

def varlen_math(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                scale=None, window_size=None, enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):
    """``torch_attn::_varlen_attn`` in plain tensor ops, one sequence at a time: torch runs it
    only with CUDA's flash or cuDNN kernels, so CPU tests register this one
    (:func:`register_varlen_math`) for the unsharded and the sharded model alike."""
    if block_table is not None or seqused_k is not None:
        raise NotImplementedError("varlen_math: packed sequences only, no paged cache")
    left, right = window_size or (-1, -1)
    right = 0 if is_causal else right
    cu_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for i in range(cu_seq_q.numel() - 1):
        q = query[int(cu_seq_q[i]):int(cu_seq_q[i + 1])].transpose(0, 1).float()
        k, v = (t[int(cu_k[i]):int(cu_k[i + 1])].transpose(0, 1).float() for t in (key, value))
        k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
        scores = q @ k.transpose(-1, -2) * scale
        gap = torch.arange(k.shape[1]) - torch.arange(q.shape[1])[:, None]  # key - query
        outside = ((gap < -left) if left >= 0 else False) | ((gap > right) if right >= 0 else False)
        scores = scores.masked_fill(outside, float("-inf"))
        lse = scores.logsumexp(-1)
        outs.append((scores - lse[..., None]).exp() @ v)
        lses.append(lse)
    out = torch.cat(outs, dim=1).transpose(0, 1).to(query.dtype).contiguous()
    return out, torch.cat(lses, dim=1), torch.zeros(2, dtype=torch.uint64)


def register_varlen_math() -> None:
    """Make :func:`varlen_math` varlen attention's CPU kernel in this process."""
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", varlen_math)


class VarlenBlock(nn.Module):
    """x + o(varlen_attn(q, k, v)) on packed sequences ``x (tokens, DIM)`` whose bounds are
    ``cu_seqlens``: 8 query heads over ``kv_heads`` (GQA by ``enable_gqa``), causal."""

    def __init__(self, kv_heads: int = 4, max_len: int = SEQ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.max_len = 8, kv_heads, DIM // 8, max_len
        self.norm = nn.RMSNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, cu_seqlens):
        from torch.nn.attention.varlen import varlen_attn

        h = self.norm(x)
        q = self.q(h).view(-1, self.heads, self.head_dim)
        k = self.k(h).view(-1, self.kv_heads, self.head_dim)
        v = self.v(h).view(-1, self.kv_heads, self.head_dim)
        y = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, self.max_len, self.max_len,
                        window_size=(-1, 0), enable_gqa=self.kv_heads != self.heads)
        return x + self.o(y.reshape(-1, DIM))


def varlen(kv_heads: int = 4):
    """(block, (packed tokens, cumulative lengths)): sequences of 5, 16 and 9 tokens."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 21, 30], dtype=torch.int32)
    return VarlenBlock(kv_heads), (torch.randn(30, DIM), cu)
