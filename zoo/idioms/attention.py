"""Head and attention idioms: GQA and MQA repeats, explicit softmax attention, masks, merged
batch and head dims, and the state-space mixers (Mamba, Mamba-2) that take attention's place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.idioms.skeleton import Attention, D, HEADS, HIDDEN, LM, MAX_SEQ, VOCAB, RMSNorm


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


class RepeatTiledKV(Attention):
    """x-transformers: ``repeat(k, 'b kvh n d -> b (r kvh) n d')``, the kv heads tiled, so query
    head ``h`` reads kv head ``h % n_kv`` (not ``h // n_rep`` as Hugging Face's repeat_kv)."""

    def attend(self, q, k, v, *extra):
        B, n_kv, T, hd = k.shape
        n_rep = self.n_heads // n_kv
        k = k[:, None].expand(B, n_rep, n_kv, T, hd).reshape(B, n_rep * n_kv, T, hd)
        v = v[:, None].expand(B, n_rep, n_kv, T, hd).reshape(B, n_rep * n_kv, T, hd)
        return super().attend(q, k, v)


class SqueezedMQA(Attention):
    """x-transformers multi-query: the one kv head squeezed (``rearrange(k, 'b 1 n d -> b n
    d')``), scores by ``einsum('b h i d, b j d -> b h i j')``, a causal ``masked_fill``."""

    def attend(self, q, k, v, *extra):
        B, _, T, hd = k.shape
        k, v = k.reshape(B, T, hd), v.reshape(B, T, hd)
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k) * hd ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        return torch.einsum("b h i j, b j d -> b h i d", attn, v)


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


class FloatMaskLM(LM):
    """diffusers' cross-attention masks (PixArt, Sana): the caller's float keep-mask ``(B, T)``,
    ``(1 - mask) * -10000`` added to every head's scores; ``forward(tokens, mask)``."""

    def layer_inputs(self, tokens, mask):
        return (((1.0 - mask.to(torch.float32)) * -10000.0)[:, None, None, :],)


def float_mask_inputs(batch: int, seq: int, seed: int) -> tuple:
    """Token ids and a float keep-mask, the last two keys of every sample masked out."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq)
    mask[:, -2:] = 0.0
    return torch.randint(0, VOCAB, (batch, seq), generator=g), mask


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
