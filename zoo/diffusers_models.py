"""diffusers models nobody here wrote, at tiny random-init configs: FLUX's transformer.

``FluxTransformer2DModel`` with one double-stream block and two single-stream blocks
(``FluxSingleTransformerBlock``: attention and an MLP side by side, ONE ``proj_out`` over their
concatenation), 2 heads of 16 with 3-axis RoPE. ``Flux`` calls it with ``return_dict=False``
and returns the prediction, so it is captured as a tensor-out module. Needs diffusers (not a
dependency of tpcompile: its test skips without it).
"""

from __future__ import annotations

import torch
from torch import nn

CHANNELS, CONTEXT, POOLED, IMAGE_TOKENS, TEXT_TOKENS = 4, 32, 32, 12, 5


class Flux(nn.Module):
    """A tiny ``FluxTransformer2DModel``: ``forward(latents, context, pooled, t, img_ids, txt_ids)``."""

    def __init__(self):
        super().__init__()
        from diffusers import FluxTransformer2DModel

        self.transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=CHANNELS, num_layers=1, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=CONTEXT,
            pooled_projection_dim=POOLED, guidance_embeds=False, axes_dims_rope=(4, 6, 6))

    def forward(self, latents, context, pooled, t, img_ids, txt_ids):
        return self.transformer(latents, context, pooled, t, img_ids, txt_ids, return_dict=False)[0]


def build(seed: int = 0) -> Flux:
    torch.manual_seed(seed)
    return Flux()


def example_inputs(batch: int = 2, seed: int = 0) -> tuple:
    """Latent tokens, text context and its pooled vector, timesteps in [0, 1), RoPE position ids."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, IMAGE_TOKENS, CHANNELS, generator=g),
            torch.randn(batch, TEXT_TOKENS, CONTEXT, generator=g),
            torch.randn(batch, POOLED, generator=g), torch.rand(batch, generator=g),
            torch.randint(0, 4, (IMAGE_TOKENS, 3), generator=g).float(), torch.zeros(TEXT_TOKENS, 3))
