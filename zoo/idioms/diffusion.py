"""A diffusion transformer (DiT) in diffusers' layout: conditioning chains beside the blocks.

Latents ``(B, C, 3, 3T)`` are cut into ``T`` patches of ``3 x 3`` by a strided Conv2d (so any token
count ``T`` makes an image; 3, not diffusers' usual 2, so that no size of the example equals its
batch of 2, which export would take for the same symbol), then ``LAYERS`` adaLN-Zero blocks and a
final adaLN layer project the tokens back to patches. As in diffusers' ``DiTTransformer2DModel``
with ``norm_type="ada_norm_zero"``, every block owns a timestep embedder (sinusoidal features ->
Linear -> SiLU -> Linear) and its modulation (SiLU -> ``Linear(D, 6D)`` chunked into shift, scale
and gate for attention and MLP), and the final layer calls the *first* block's embedder again. The
attention (non-causal SDPA, separate q/k/v/o) and the GELU MLP are the blocks' two column -> row
chains; the conditioning runs on ``(B, D)``: one row per sample, whatever the image size, which is
why a hand plan keeps it whole. ``SingleStreamDiT`` swaps in Flux's single-stream blocks; the
other classes are the ways diffusers' models write the same blocks (named in each).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.idioms.skeleton import D, HIDDEN, LAYERS, Attention, RMSNorm

CHANNELS, PATCH, FREQUENCIES = 4, 3, 32
TEXT = 2  # text tokens the single-stream variants carry beside the image's


class FullAttention(Attention):
    """The baseline attention, every token seeing every other (an image has no order)."""

    def attend(self, q, k, v, *extra):
        return F.scaled_dot_product_attention(q, k, v)


class GeluMLP(nn.Module):
    """DiT's MLP: fc2(gelu_tanh(fc1 x)), with biases."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of the timestep -> Linear -> SiLU -> Linear: ``(B,) -> (B, D)``."""

    def __init__(self):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(FREQUENCIES, D), nn.Linear(D, D)

    def forward(self, t):
        half = FREQUENCIES // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None]
        return self.linear_2(F.silu(self.linear_1(torch.cat([angles.cos(), angles.sin()], -1))))


def modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """adaLN-Zero: the block's own embedder conditions both residual branches."""

    def __init__(self):
        super().__init__()
        self.emb = TimestepEmbedder()
        self.adaLN = nn.Linear(D, 6 * D)
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn, self.mlp = FullAttention(), GeluMLP()

    def forward(self, x, t):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = \
            self.adaLN(F.silu(self.emb(t))).chunk(6, dim=-1)
        x = x + gate_a[:, None] * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        return x + gate_m[:, None] * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class DiT(nn.Module):
    """Patch embed -> adaLN-Zero blocks -> final adaLN -> patches; ``forward(latents, t)``."""

    def __init__(self, block=DiTBlock):
        super().__init__()
        self.patch = nn.Conv2d(CHANNELS, D, PATCH, stride=PATCH)
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm_out = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.proj_out_1 = nn.Linear(D, 2 * D)
        self.proj_out_2 = nn.Linear(D, PATCH * PATCH * CHANNELS)

    def forward(self, latents, t):
        B, C, H, W = latents.shape
        x = self.patch(latents).flatten(2).transpose(1, 2)  # (B, T, D)
        cond = self.condition(t)
        for layer in self.layers:
            x = layer(x, cond)
        shift, scale = self.proj_out_1(F.silu(self.final_condition(t, cond))).chunk(2, dim=-1)
        x = self.proj_out_2(modulate(self.norm_out(x), shift, scale))
        x = x.view(B, H // PATCH, W // PATCH, PATCH, PATCH, C)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)

    def condition(self, t):
        """What every block is conditioned on: the timestep (each block embeds it itself)."""
        return t

    def final_condition(self, t, cond):
        """The final layer's conditioning: the first block's embedder called again."""
        return self.layers[0].emb(t)


def dit_inputs(batch: int, seq: int, seed: int) -> tuple:
    """Latents of ``seq`` patches and one timestep per sample."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, CHANNELS, PATCH, PATCH * seq, generator=g),
            torch.randint(0, 1000, (batch,), generator=g))


class SingleStreamAttention(FullAttention):
    """Flux's single-stream attention: q / k / v projections with biases and per-head RMSNorms
    on q and k, and no output projection (the block's ``proj_out`` is it): ``(B, T, D)`` out."""

    def init_projections(self, linear):
        self.wq, self.wk, self.wv = (linear(D, D) for _ in range(3))
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)

    def position(self, q, k):
        return self.q_norm(q), self.k_norm(k)

    def output(self, y):
        return y.reshape(*y.shape[:2], -1)


class SingleStreamBlock(nn.Module):
    """diffusers' ``FluxSingleTransformerBlock``: adaLN-single (``Linear(D, 3D)`` of the shared
    conditioning: shift, scale, gate), attention and a GELU MLP side by side on one normed input,
    and ONE output projection over ``cat([attn, mlp], -1)``, gated into the residual."""

    def __init__(self, hidden: int = 4 * D):
        super().__init__()
        self.adaLN = nn.Linear(D, 3 * D)
        self.norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = SingleStreamAttention()
        self.proj_mlp = nn.Linear(D, hidden)
        self.proj_out = nn.Linear(D + hidden, D)

    def forward(self, x, cond, text=None):
        """With ``text`` (Flux), the text tokens join the image's and both come out apart."""
        joined = x if text is None else torch.cat([text, x], dim=1)
        shift, scale, gate = self.adaLN(F.silu(cond)).chunk(3, dim=-1)
        h = modulate(self.norm(joined), shift, scale)
        mlp = F.gelu(self.proj_mlp(h), approximate="tanh")
        attn = self.attn(self.attention_tokens(h))
        out = joined + gate[:, None] * self.proj_out(torch.cat([attn, mlp], dim=-1))
        return out if text is None else (out[:, :TEXT], out[:, TEXT:])

    def attention_tokens(self, h):
        return h


class SingleStreamDiT(DiT):
    """The DiT skeleton with ``LAYERS`` single-stream blocks conditioned on one shared timestep
    embedding (Flux's ``time_text_embed``), the final layer's too; ``forward(latents, t)``."""

    def __init__(self, block=SingleStreamBlock):
        super().__init__(block=block)
        self.emb = TimestepEmbedder()

    def condition(self, t):
        return self.emb(t)

    def final_condition(self, t, cond):
        return cond


class DroppedOutDiTBlock(DiTBlock):
    """AuraFlow: each branch dropped out between its output projection and its gate."""

    def forward(self, x, t):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = \
            self.adaLN(F.silu(self.emb(t))).chunk(6, dim=-1)
        a = self.attn(modulate(self.norm1(x), shift_a, scale_a))
        x = x + gate_a[:, None] * F.dropout(a, 0.1, self.training)
        m = self.mlp(modulate(self.norm2(x), shift_m, scale_m))
        return x + gate_m[:, None] * F.dropout(m, 0.1, self.training)


class ReorderedSingleStreamBlock(SingleStreamBlock):
    """HunyuanImage's single-stream block: attention reads its normed tokens reassembled from
    two slices, ``cat([h[:, :-TEXT], h[:, -TEXT:]])`` (where its rotary embedding applies to the
    image tokens only), the MLP reads them as they are."""

    def attention_tokens(self, h):
        return torch.cat([h[:, :-TEXT], h[:, -TEXT:]], dim=1)


class TextTokensDiT(SingleStreamDiT):
    """Flux's single-stream stack: ``TEXT`` text tokens (here a projection of the conditioning)
    ride beside the image tokens through every block, each block joining and splitting them
    again, and the last block's text tokens feed nothing."""

    def __init__(self, block=SingleStreamBlock):
        super().__init__(block=block)
        self.context = nn.Linear(D, TEXT * D)

    def forward(self, latents, t):
        B, C, H, W = latents.shape
        cond = self.emb(t)
        x = self.patch(latents).flatten(2).transpose(1, 2)
        text = self.context(cond).view(B, TEXT, D)
        for layer in self.layers:
            text, x = layer(x, cond, text)
        shift, scale = self.proj_out_1(F.silu(cond)).chunk(2, dim=-1)
        x = self.proj_out_2(modulate(self.norm_out(x), shift, scale))
        x = x.view(B, H // PATCH, W // PATCH, PATCH, PATCH, C)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)
