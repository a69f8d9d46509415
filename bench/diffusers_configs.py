"""Every transformer / UNet model class of the installed diffusers at a tiny config
(bench/diffusers_sweep.py); its example inputs: bench/diffusers_inputs.py.

The classes: ``diffusers.models``' ``*Transformer*Model`` and ``UNet*Model`` names, enumerated
(``classes``), none hand-picked. A class's config is its ``__init__`` defaults scaled down by
parameter name (``_shrink``: block counts 2, so each list of blocks repeats as a real model's
does (one block per list is no repeated block for the gradient-sync buckets, which then filed
a sync of one list under the next), resnets per UNet level 1, 2 heads (and kv heads) of 16,
model widths 32 and
FFN widths 64, text / pooled / caption / image-embedding widths 32, sample sizes 8, RoPE axes
rescaled to sum to the head width, 5 video frames, text lengths 5), then ``OVERRIDES`` where a
class needs fields that agree with each other or with its inputs (UNet channel lists, channel
counts, patch sizes). A class these heuristics cannot build is a ``not built`` row with the
error: a config or input problem of this sweep, not tpcompile's; a class of ``SKIP`` cannot
run tiny on CPU at all, and its row says why.
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from bench.diffusers_inputs import HEAD_DIM, HEADS, SIDE, TEXT_DIM, TEXT_TOKENS, config_of, wrap

# per-class fields the name rules cannot infer (applied after them)
OVERRIDES: dict[str, dict] = {
    "FluxTransformer2DModel": {"in_channels": 4},
    "Krea2Transformer2DModel": {"num_text_layers": 1},  # the input's encoder layers, no blocks
    "Flux2Transformer2DModel": {"in_channels": 4},
    "ChromaTransformer2DModel": {"in_channels": 4},
    "BriaTransformer2DModel": {"in_channels": 4},
    "LongCatImageTransformer2DModel": {"in_channels": 4},
    "OvisImageTransformer2DModel": {"in_channels": 4},
    "UNet2DConditionModel": {"block_out_channels": (32, 64), "norm_num_groups": 32,
                             "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
                             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")},
    "UNet2DModel": {"block_out_channels": (32, 64), "norm_num_groups": 32,
                    "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
                    "up_block_types": ("AttnUpBlock2D", "UpBlock2D")},
    "UNetControlNetXSModel": {"block_out_channels": (32, 64), "ctrl_block_out_channels": (4, 8),
                             "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
                             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
                             "ctrl_conditioning_embedding_out_channels": (8, 16)},
    "UNetMotionModel": {"block_out_channels": (32, 64), "norm_num_groups": 32,
                        "down_block_types": ("CrossAttnDownBlockMotion", "DownBlockMotion"),
                        "up_block_types": ("UpBlockMotion", "CrossAttnUpBlockMotion"),
                        "motion_num_attention_heads": 2},
    "UNet3DConditionModel": {"block_out_channels": (32, 64), "norm_num_groups": 32,
                             "down_block_types": ("CrossAttnDownBlock3D", "DownBlock3D"),
                             "up_block_types": ("UpBlock3D", "CrossAttnUpBlock3D")},
    "WanVACETransformer3DModel": {"vace_layers": [0], "vace_in_channels": 4},
    # its FFN is int(dim / 3 * 8) wide: 85 at width 32, which no two ranks split evenly (the
    # bound keeps it whole, the plan cuts it 43 / 42); 128 at width 48, as 10240 at 3840
    "ZImageTransformer2DModel": {"dim": 48, "n_heads": 2, "n_kv_heads": 2, "axes_dims": [8, 8, 8]},
    "LatteTransformer3DModel": {"patch_size": 2, "in_channels": 4, "caption_channels": TEXT_DIM,
                                "cross_attention_dim": TEXT_DIM, "video_length": 2},
    "LTXVideoTransformer3DModel": {"in_channels": 8, "out_channels": 8},
    "UNetSpatioTemporalConditionModel": {
        "block_out_channels": (32, 64), "num_attention_heads": (2, 2), "in_channels": 4,
        "down_block_types": ("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        "up_block_types": ("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 24, "num_frames": 2},
    "HiDreamImageTransformer2DModel": {"patch_size": 2, "in_channels": 4, "llama_layers": (0, 1, 2, 3),
                                       "caption_channels": (TEXT_DIM, TEXT_DIM),
                                       "axes_dims_rope": (4, 6, 6), "max_resolution": (SIDE, SIDE)},
    "EasyAnimateTransformer3DModel": {"patch_size": 2, "in_channels": 4, "out_channels": 4,
                                      "text_embed_dim_t5": TEXT_DIM},
    "CosmosTransformer3DModel": {"concat_padding_mask": False},  # its resize needs torchvision
    "UNet1DModel": {"extra_in_channels": 64},  # the input meets its 64-channel Fourier time embedding
    "PRXTransformer2DModel": {"axes_dim": (8, 8)},
    "Kandinsky6Transformer3DModel": {"visual_cond": False},
    "WanAnimateTransformer3DModel": {  # an 8-pixel face: one motion-encoder block, 4x4 to 1x1
        "in_channels": 2 * 4 + 4, "latent_channels": 4, "out_channels": 4, "motion_encoder_size": 8,
        "motion_encoder_channel_sizes": {"4": 8, "8": 8}, "motion_style_dim": TEXT_DIM,
        "motion_dim": 4, "motion_encoder_dim": TEXT_DIM, "face_encoder_hidden_dim": TEXT_DIM,
        "face_encoder_num_heads": HEADS, "inject_face_latents_blocks": 1, "image_dim": TEXT_DIM},
    "BriaFibo2Transformer2DModel": {"injection_layer_ids": (0,), "min_num_gist_tokens": 4,
                                    "max_num_gist_tokens": 8, "gist_step": 4,
                                    "gist_min_text_len": 4, "gist_max_text_len": 8},
    "SanaWMTransformer3DModel": {"in_channels": 8, "linear_head_dim": HEAD_DIM,
                                 "use_chunk_plucker_post_attn": False},
    "SanaWMLTX2RefinerTransformer3DModel": {"in_channels": 8, "out_channels": 8},
    "MiniMaxH3Transformer3DModel": {"in_channels": 4, "audio_in_channels": 8,
                                    "time_embed_hidden_dim": 32, "time_embed_dim": 32,
                                    "rope_freq_dim": 2},  # rotates 6 * 2 of the 16 channels
    "LTX2VideoTransformer3DModel": {"in_channels": 8, "out_channels": 8, "audio_in_channels": 8,
                                    "audio_out_channels": 8},
    "Kandinsky6SRTransformer3DModel": {"in_visual_dim": 8, "out_visual_dim": 8},
    "OmniGenTransformer2DModel": {"vocab_size": 64, "pad_token_id": 0, "rope_scaling": {
        "short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [1.0] * (HEAD_DIM // 2)}},
    "Ideogram4Transformer2DModel": {"in_channels": 8, "mrope_section": (2, 2, 2)},
    "HunyuanVideoFramepackTransformer3DModel": {  # forward calls both unconditionally
        "has_clean_x_embedder": True, "has_image_proj": True, "image_proj_dim": TEXT_DIM},
    "DreamLiteTransformer2DModel": {"in_channels": 32, "norm_num_groups": 32},
    "AceStepTransformer1DModel": {"in_channels": 24, "audio_acoustic_hidden_dim": 8},
    "Transformer2DModel": {"in_channels": 32, "norm_num_groups": 32},
    "DualTransformer2DModel": {"in_channels": 32, "norm_num_groups": 32},
    "TransformerTemporalModel": {"in_channels": 32, "norm_num_groups": 32},
}

# classes this sweep cannot run tiny on CPU, and why (a "not built" row with the reason)
SKIP: dict[str, str] = {
    "WanAnimate2Transformer3DModel": (
        "two passes: a reference pass (kv_cache_mode='extract') whose product is the KV cache "
        "it fills, then the denoising pass ('cached') through a flex-attention BlockMask, which "
        "has no backward on CPU"),
}


class CannotBuildTiny(Exception):
    """A class of ``SKIP``: the reason is the message."""


_PER_LEVEL = re.compile(r"(^|_)layers_per_block$")  # a UNet level's resnets
_LAYERS = re.compile(r"(^|_)(num_layers|layers|depth|num_blocks)$|^num_\w*(layers|blocks)$")
_HEADS = re.compile(r"^(text_|audio_)?(num_attention_heads|num_heads|attention_heads|heads|n_heads|"
                    r"num_key_value_heads|n_kv_heads|num_kv_heads)$")
_HEAD_DIM = re.compile(r"^(audio_)?(attention_head_dim|head_dim|rotary_dim)$")
_TEXT = re.compile(r"(joint_attention_dim|cross_attention_dim|caption_channels|text_dim|"
                   r"pooled_projection_dim|text_embed_dim|caption_projection_dim|context_dim|"
                   r"text_in_dim|cap_feat_dim|context_in_dim|text_emb_dim|text_embed_2_dim|"
                   r"encoder_hidden_size|condition_dim|in_text_dim2?|image_embed_dim|llm_features_dim|"
                   r"text_hidden_dim|text_encoder_dim)$")
_WIDTH = re.compile(r"^(hidden_size|dim|inner_dim|model_dim)$")
_FFN = re.compile(r"^(text_|audio_)?(ffn_dim|ff_dim|intermediate_size|ffn_hidden_size|ff_inner_dim|"
                  r"moe_intermediate_dim)$")
_SIZE = re.compile(r"^(sample_size|sample_height|sample_width)$")
_ROPE = re.compile(r"^(axes_dims?_rope|rope_axes_dim|rope_dim|axes_dims|rope_dim_list|axes_dim)$")
# video lengths in frames: 2 latent frames (CogVideoX compresses 4 frames after the first into one)
_FRAMES = re.compile(r"^sample_frames$")
_TEXT_LEN = re.compile(r"^(max_text_seq_length|text_len)$")
# name rule -> tiny value, first match wins
_RULES = ((_PER_LEVEL, 1), (_LAYERS, 2), (_HEADS, HEADS), (_HEAD_DIM, HEAD_DIM), (_TEXT, TEXT_DIM),
          (_WIDTH, HEADS * HEAD_DIM), (_FFN, 2 * HEADS * HEAD_DIM), (_SIZE, SIDE),
          (_FRAMES, 5), (_TEXT_LEN, TEXT_TOKENS))


def classes() -> dict[str, type]:
    """``diffusers.models``' transformer and UNet model classes, by name."""
    import diffusers.models as models

    return {n: getattr(models, n) for n in dir(models)
            if n.endswith("Model") and ("Transformer" in n or n.startswith("UNet"))}


def _rope_axes(axes, total: int = HEAD_DIM) -> tuple:
    """RoPE axes that sum to the tiny head width, each even (the rotation pairs channels)."""
    n = len(axes)
    each = 2 * ((total // 2) // n)
    extra = (total - each * n) // 2
    return tuple(each + (2 if i >= n - extra else 0) for i in range(n))


def _shrink(name: str, cls: type) -> dict:
    kwargs = {}
    for p, param in inspect.signature(cls.__init__).parameters.items():
        value = param.default
        if isinstance(value, bool) or not isinstance(value, (int, tuple, list)):
            continue
        tiny = next((v for rule, v in _RULES if rule.search(p)), None)
        if isinstance(value, int) and tiny is not None:
            kwargs[p] = tiny
        elif _ROPE.match(p) and all(isinstance(v, int) for v in value):
            kwargs[p] = _rope_axes(value)
    return {**kwargs, **OVERRIDES.get(name, {})}


def build(name: str) -> nn.Module:
    """``name`` at its tiny config, ``nn.Dropout`` off: the sharded and the unsharded model draw
    dropout from different generator streams (UNet3D's TemporalConvLayer keeps p=0.1). Weights
    initialised to zero (output layers, AdaLN-zero modulations, pad tokens) get ``randn * 0.05``:
    a zero weight hides what flows through it (Ernie's output is all zeros otherwise)."""
    if name in SKIP:
        raise CannotBuildTiny(SKIP[name])
    torch.manual_seed(0)
    cls = classes()[name]
    model = cls(**_shrink(name, cls))
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dim() >= 2 and not p.any():
                p.copy_(torch.randn_like(p) * 0.05)
    return wrap(model)


def n_layers(model: nn.Module) -> int:
    """The tiny config's largest layer count (what the verdict expects to find per layer)."""
    cfg = config_of(model.model)
    return max([v for k, v in cfg.items() if _LAYERS.search(k) and isinstance(v, int)] or [1])
