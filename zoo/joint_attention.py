"""A small diffusion transformer with joint attention (SD3's MMDiT), written as diffusers does.

Two token streams, image and context, each with its own q / k / v projections, output
projection, MLP and adaLN modulation (shift, scale and gate computed from a conditioning
vector by ``Linear(silu(y))``); attention runs once over the two streams concatenated along
the sequence and is split back. The last block is *context-pre-only*: its context tokens
are projected into the attention (the image tokens read them) but have no output
projection and no MLP, and the model returns the image stream alone, so part of that
block's attention output (the context rows) reaches no output and carries no gradient.

``tests/unit/test_executed_collectives.py`` plans it and compares what ``explain`` says the
rewritten module issues with what it executes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, LAYERS, IMAGE_TOKENS, CONTEXT_TOKENS = 64, 4, 2, 16, 8


def _modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Stream(nn.Module):
    """One stream's weights in a block: adaLN, q / k / v, and unless ``pre_only`` the output
    projection and the MLP (``pre_only``: shift and scale only, SD3's final context)."""

    def __init__(self, dim: int, pre_only: bool = False):
        super().__init__()
        self.pre_only = pre_only
        self.ada = nn.Linear(dim, (2 if pre_only else 6) * dim)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        if not pre_only:
            self.out = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def project(self, x, y):
        """(q, k, v) in heads, and the modulation the rest of the block reads."""
        mod = self.ada(F.silu(y)).chunk(2 if self.pre_only else 6, dim=-1)
        h = _modulate(self.norm1(x), mod[0], mod[1])
        b, t, d = h.shape
        qkv = [p(h).view(b, t, HEADS, d // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v)]
        return qkv, mod

    def finish(self, x, attn, mod):
        """The residual updates after attention: output projection, then the MLP."""
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
        x = x + gate_msa.unsqueeze(1) * self.out(attn)
        h = _modulate(self.norm2(x), shift_mlp, scale_mlp)
        return x + gate_mlp.unsqueeze(1) * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class JointBlock(nn.Module):
    """SD3's ``JointTransformerBlock``: attention over [context, image] tokens at once."""

    def __init__(self, dim: int, context_pre_only: bool = False):
        super().__init__()
        self.image = Stream(dim)
        self.context = Stream(dim, pre_only=context_pre_only)

    def forward(self, x, c, y):
        (qi, ki, vi), mod_i = self.image.project(x, y)
        (qc, kc, vc), mod_c = self.context.project(c, y)
        q, k, v = (torch.cat(pair, dim=2) for pair in ((qc, qi), (kc, ki), (vc, vi)))
        attn = F.scaled_dot_product_attention(q, k, v)
        b, h, t, hd = attn.shape
        attn = attn.transpose(1, 2).reshape(b, t, h * hd)
        attn_c, attn_i = attn[:, :c.shape[1]], attn[:, c.shape[1]:]
        x = self.image.finish(x, attn_i, mod_i)
        c = None if self.context.pre_only else self.context.finish(c, attn_c, mod_c)
        return x, c


class MMDiT(nn.Module):
    """Patch and caption embeddings, ``layers`` joint blocks (the last context-pre-only), and
    SD3's final adaLN + linear back to patches. ``forward(latents, context, timestep)``."""

    def __init__(self, dim: int = DIM, layers: int = LAYERS, patch: int = 16, text: int = 32):
        super().__init__()
        self.patch_in, self.context_in = nn.Linear(patch, dim), nn.Linear(text, dim)
        self.time_in = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(JointBlock(dim, context_pre_only=i == layers - 1)
                                    for i in range(layers))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(dim, 2 * dim)
        self.proj_out = nn.Linear(dim, patch)

    def forward(self, latents, context, timestep):
        x, c = self.patch_in(latents), self.context_in(context)
        y = self.time_in(timestep.unsqueeze(-1))
        for block in self.blocks:
            x, c = block(x, c, y)
        scale, shift = self.ada_out(F.silu(y)).chunk(2, dim=-1)
        return self.proj_out(_modulate(self.norm_out(x), shift, scale))


def build(seed: int = 0, **sizes) -> MMDiT:
    torch.manual_seed(seed)
    return MMDiT(**sizes)


def example_inputs(model: MMDiT, batch: int = 2) -> tuple:
    g = torch.Generator().manual_seed(1)
    patch, text = model.patch_in.in_features, model.context_in.in_features
    return (torch.randn(batch, IMAGE_TOKENS, patch, generator=g),
            torch.randn(batch, CONTEXT_TOKENS, text, generator=g),
            torch.rand(batch, generator=g))
