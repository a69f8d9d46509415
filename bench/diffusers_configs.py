"""Every transformer / UNet model class of the installed diffusers at a tiny config, with example
inputs read off its forward signature, wrapped to return one tensor (bench/diffusers_sweep.py).

The classes: ``diffusers.models``' ``*Transformer*Model`` and ``UNet*Model`` names, enumerated
(``classes``), none hand-picked. A class's config is its ``__init__`` defaults scaled down by
parameter name (``_shrink``: layer counts 1, 2 heads of 16, text / pooled / caption widths 32,
sample sizes 8), then ``OVERRIDES`` where a class needs fields that agree with each other
(UNet channel lists, RoPE axes that sum to the head width). Inputs: each forward parameter
without a default (and the usual conditioning ones with one) made from its name
(``_input``); the model runs with ``return_dict=False`` and its first tensor out is the
output (``Wrapped``). A class these heuristics cannot build is a ``not built`` row with the
error: a config or input problem of this sweep, not tpcompile's.
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

BATCH, TEXT_TOKENS, TEXT_DIM, SIDE = 2, 5, 32, 8
HEADS, HEAD_DIM = 2, 16

# per-class fields the name rules cannot infer (applied after them)
OVERRIDES: dict[str, dict] = {
    "FluxTransformer2DModel": {"axes_dims_rope": (4, 6, 6), "in_channels": 4},
    "Flux2Transformer2DModel": {"axes_dims_rope": (4, 4, 4, 4), "in_channels": 4},
    "ChromaTransformer2DModel": {"axes_dims_rope": (4, 6, 6), "in_channels": 4},
    "BriaTransformer2DModel": {"axes_dims_rope": (4, 6, 6), "in_channels": 4},
    "LongCatImageTransformer2DModel": {"axes_dims_rope": (4, 6, 6), "in_channels": 4},
    "OvisImageTransformer2DModel": {"axes_dims_rope": (4, 6, 6), "in_channels": 4},
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
    "LatteTransformer3DModel": {"patch_size": 2, "in_channels": 4, "caption_channels": TEXT_DIM,
                                "cross_attention_dim": TEXT_DIM, "video_length": 2},
    "LTXVideoTransformer3DModel": {"in_channels": 8, "out_channels": 8},
    "UNetSpatioTemporalConditionModel": {
        "block_out_channels": (32, 64), "num_attention_heads": (2, 2), "in_channels": 4,
        "down_block_types": ("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        "up_block_types": ("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 24, "num_frames": 2},
    "HiDreamImageTransformer2DModel": {"patch_size": 2},
    "EasyAnimateTransformer3DModel": {"patch_size": 2, "in_channels": 4, "out_channels": 4,
                                      "text_embed_dim_t5": TEXT_DIM},
    "CosmosTransformer3DModel": {"concat_padding_mask": False},  # its resize needs torchvision
    "UNet1DModel": {"extra_in_channels": 64},  # the input meets its 64-channel Fourier time embedding
    "PRXTransformer2DModel": {"axes_dim": (8, 8)},
    "Kandinsky6Transformer3DModel": {"visual_cond": False},
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

_PACKED = TEXT_TOKENS + SIDE * SIDE // 4  # text then image tokens in one sequence
_OMNI = _PACKED + 1  # OmniGen's sequence: text tokens, one time token, image tokens
_H3 = TEXT_TOKENS + 16 + 4  # MiniMaxH3's rows: text, video, audio
_PER_FRAME_T = {p: lambda: torch.tensor([[0.3, 0.4], [0.6, 0.7]]) for p in ("timestep", "r_timestep")}
# per-class forward arguments the name rules cannot make (non-tensors are fixed, not inputs)
INPUTS: dict[str, dict] = {
    "AceStepTransformer1DModel": {  # channels last; context and latents concatenate to in_channels
        "hidden_states": lambda: torch.randn(BATCH, 16, 8),
        "context_latents": lambda: torch.randn(BATCH, 16, 16)},
    "AnyFlowFARTransformer3DModel": {"chunk_partition": lambda: [1, 1], **_PER_FRAME_T},
    "AnyFlowTransformer3DModel": _PER_FRAME_T,
    "WanVACETransformer3DModel": {"control_hidden_states": lambda: torch.randn(BATCH, 4, 2, SIDE, SIDE)},
    "UNetSpatioTemporalConditionModel": {"added_time_ids": lambda: torch.randn(BATCH, 3)},
    "TransformerTemporalModel": {"encoder_hidden_states": lambda: None},  # self-attention only
    "LatteTransformer3DModel": {"encoder_attention_mask": lambda: None},  # per video, not frame
    "HunyuanVideoFramepackTransformer3DModel": {  # forward reads all three history latents
        "indices_latents": lambda: torch.arange(2), "indices_latents_clean": lambda: torch.arange(1),
        "latents_clean": lambda: torch.randn(BATCH, 16, 1, SIDE, SIDE),
        "indices_latents_history_2x": lambda: torch.arange(2),
        "latents_history_2x": lambda: torch.randn(BATCH, 16, 2, SIDE, SIDE),
        "indices_latents_history_4x": lambda: torch.arange(4),
        "latents_history_4x": lambda: torch.randn(BATCH, 16, 4, SIDE, SIDE)},
    "Ideogram4Transformer2DModel": {  # one packed sequence: the text tokens, then the image's
        "hidden_states": lambda: torch.randn(BATCH, _PACKED, 8),
        "encoder_hidden_states": lambda: torch.randn(BATCH, _PACKED, TEXT_DIM),
        "position_ids": lambda: torch.arange(_PACKED)[None, :, None].expand(BATCH, -1, 3),
        "segment_ids": lambda: torch.zeros(BATCH, _PACKED, dtype=torch.long),
        "indicator": lambda: torch.where(torch.arange(_PACKED) < TEXT_TOKENS, 3, 2).expand(
            BATCH, -1)},  # LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR
    "Krea2Transformer2DModel": {  # text: (batch, tokens, encoder layers, width); positions packed
        "hidden_states": lambda: torch.randn(BATCH, SIDE * SIDE // 4, 64),
        "encoder_hidden_states": lambda: torch.randn(BATCH, TEXT_TOKENS, 1, TEXT_DIM),
        "position_ids": lambda: torch.arange(_PACKED)[:, None].expand(-1, 3)},
    "Kandinsky5Transformer3DModel": {  # channels-last video; RoPE positions per axis of the patches
        "hidden_states": lambda: torch.randn(BATCH, 2, SIDE, SIDE, 4),
        "visual_rope_pos": lambda: (torch.arange(2), torch.arange(SIDE // 2), torch.arange(SIDE // 2)),
        "text_rope_pos": lambda: torch.arange(TEXT_TOKENS)},
    "JoyImageEditPlusTransformer3DModel": {  # patchified: (batch, patches, channels, pt, ph, pw)
        "hidden_states": lambda: torch.randn(BATCH, SIDE * SIDE // 4, 16, 1, 2, 2),
        "shape_list": lambda: [[(1, SIDE // 2, SIDE // 2)]] * BATCH},
    "OmniGenTransformer2DModel": {  # text ids, no input images; one sequence: text, time, image
        "input_ids": lambda: torch.arange(1, TEXT_TOKENS + 1).expand(BATCH, -1),
        "input_img_latents": lambda: [], "input_image_sizes": lambda: {},
        "attention_mask": lambda: torch.ones(BATCH, _OMNI, _OMNI),
        "position_ids": lambda: torch.arange(_OMNI).expand(BATCH, -1)},
    "Kandinsky6Transformer3DModel": {"hidden_states": lambda: torch.randn(BATCH, 2, SIDE, SIDE, 16)},
    "Kandinsky6SRTransformer3DModel": {  # channels last: latents, low-res condition, mask
        "hidden_states": lambda: torch.randn(BATCH, 2, SIDE, SIDE, 2 * 8 + 1)},
    "DualTransformer2DModel": {  # splits the text at its fixed condition_lengths 77 + 257
        "encoder_hidden_states": lambda: torch.randn(BATCH, 77 + 257, TEXT_DIM)},
    "ZImageTransformer2DModel": {"x": lambda: torch.randn(BATCH, 16, 1, SIDE, SIDE)},  # C F H W
    "UNetControlNetXSModel": {  # its conditioning embedding halves the image once per level
        "controlnet_cond": lambda: torch.randn(BATCH, 3, 2 * SIDE, 2 * SIDE)},
    "GlmImageTransformer2DModel": {  # one prior (VQ) token per image token, none dropped
        "prior_token_id": lambda: torch.zeros(BATCH, SIDE * SIDE // 4, dtype=torch.long),
        "prior_token_drop": lambda: torch.zeros(BATCH, SIDE * SIDE // 4, dtype=torch.bool)},
    "MiniMaxMusic3Transformer1DModel": {  # the condition is concatenated to the latents' channels
        "encoder_hidden_states": lambda: torch.randn(BATCH, 32, TEXT_DIM)},
    "Lumina2Transformer2DModel": {"encoder_attention_mask": lambda: torch.ones(BATCH, TEXT_TOKENS,
                                                                               dtype=torch.bool)},
    "LTXVideoTransformer3DModel": {  # latents as (batch, frames * height * width, channels)
        "hidden_states": lambda: torch.randn(BATCH, 2 * SIDE * SIDE, 8),
        "num_frames": lambda: 2, "height": lambda: SIDE, "width": lambda: SIDE},
    "LTX2VideoTransformer3DModel": {  # video and audio latents as token sequences
        "hidden_states": lambda: torch.randn(BATCH, 2 * SIDE * SIDE, 8),
        "audio_hidden_states": lambda: torch.randn(BATCH, 4, 8),
        "audio_encoder_hidden_states": lambda: torch.randn(BATCH, TEXT_TOKENS, TEXT_DIM),
        "num_frames": lambda: 2, "height": lambda: SIDE, "width": lambda: SIDE,
        "audio_num_frames": lambda: 4},
    "MiniMaxH3Transformer3DModel": {  # one packed sequence: text, video, audio rows; one timestep
        "hidden_states": lambda: torch.randn(BATCH, 16, 4 * 4),
        "audio_hidden_states": lambda: torch.randn(BATCH, 4, 8),
        "timestep": lambda: torch.tensor([0.5]),
        "timestep_indices": lambda: torch.zeros(_H3, dtype=torch.long),
        "token_tags": lambda: torch.tensor([1] * TEXT_TOKENS + [0] * 16 + [2] * 4),
        "position_ids": lambda: torch.arange(_H3)[:, None].expand(-1, 3),
        "text_indices": lambda: torch.arange(TEXT_TOKENS),
        "video_indices": lambda: torch.arange(TEXT_TOKENS, TEXT_TOKENS + 16),
        "audio_indices": lambda: torch.arange(TEXT_TOKENS + 16, _H3)},
    "QwenImage21Transformer2DModel": {  # text slots, then image slots of 2x2 latent tokens each
        "img_mask": lambda: torch.arange(TEXT_TOKENS + SIDE * SIDE // 16).expand(BATCH, -1)
        >= TEXT_TOKENS},
}

# classes whose forward takes these arguments as lists of per-sample tensors
UNBATCHED = {"ZImageTransformer2DModel": ("x", "cap_feats")}

# video models whose latents are (batch, frames, channels, height, width)
FRAMES_FIRST = ("CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel",
                "AnyFlowTransformer3DModel", "AnyFlowFARTransformer3DModel",
                "UNetSpatioTemporalConditionModel")

_LAYERS = re.compile(r"(^|_)(num_layers|layers|depth|num_blocks|layers_per_block)$|"
                     r"^num_\w*(layers|blocks)$")
_HEADS = re.compile(r"^(text_|audio_)?(num_attention_heads|num_heads|attention_heads|heads|n_heads|"
                    r"num_key_value_heads|n_kv_heads|num_kv_heads)$")
_HEAD_DIM = re.compile(r"^(audio_)?(attention_head_dim|head_dim|rotary_dim)$")
_TEXT = re.compile(r"(joint_attention_dim|cross_attention_dim|caption_channels|text_dim|"
                   r"pooled_projection_dim|text_embed_dim|caption_projection_dim|context_dim|"
                   r"text_in_dim|cap_feat_dim|context_in_dim|text_emb_dim|text_embed_2_dim|"
                   r"encoder_hidden_size|condition_dim|in_text_dim2?|image_embed_dim|llm_features_dim|"
                   r"text_hidden_dim)$")
_WIDTH = re.compile(r"^(hidden_size|dim|inner_dim|model_dim)$")
_FFN = re.compile(r"^(text_|audio_)?(ffn_dim|ff_dim|intermediate_size|ffn_hidden_size|ff_inner_dim|"
                  r"moe_intermediate_dim)$")
_SIZE = re.compile(r"^(sample_size|sample_height|sample_width)$")
_ROPE = re.compile(r"^(axes_dims?_rope|rope_axes_dim|rope_dim|axes_dims|rope_dim_list|axes_dim)$")
# video lengths in frames: 2 latent frames (CogVideoX compresses 4 frames after the first into one)
_FRAMES = re.compile(r"^sample_frames$")
_TEXT_LEN = re.compile(r"^(max_text_seq_length|text_len)$")
# name rule -> tiny value, first match wins
_RULES = ((_LAYERS, 1), (_HEADS, HEADS), (_HEAD_DIM, HEAD_DIM), (_TEXT, TEXT_DIM),
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
    dropout from different generator streams (UNet3D's TemporalConvLayer keeps p=0.1)."""
    torch.manual_seed(0)
    cls = classes()[name]
    model = cls(**_shrink(name, cls))
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    names, values = example_arguments(model)
    fixed = {n: v for n, v in zip(names, values) if not isinstance(v, torch.Tensor)}
    given = [(n, v) for n, v in zip(names, values) if n not in fixed]
    return Wrapped(model, [n for n, _ in given], tuple(v for _, v in given), fixed)


def n_layers(model: nn.Module) -> int:
    """The tiny config's largest layer count (what the verdict expects to find per layer)."""
    cfg = model.model.config
    return max([v for k, v in cfg.items() if _LAYERS.search(k) and isinstance(v, int)] or [1])


def _channels(cfg) -> int:
    return next((cfg[k] for k in ("in_channels", "in_dim", "latent_channels", "num_channels")
                 if isinstance(cfg.get(k), int)), 4)


def _latent(name: str, cfg, tokens: bool) -> torch.Tensor:
    c = _channels(cfg)
    if tokens:  # Flux-style: already patchified (B, N, C)
        return torch.randn(BATCH, SIDE * SIDE // 4, c)
    if name in FRAMES_FIRST:
        return torch.randn(BATCH, 2, c, SIDE, SIDE)
    if "3D" in name or "Motion" in name or "Spatio" in name:
        return torch.randn(BATCH, c, 2, SIDE, SIDE)
    if "1D" in name:
        return torch.randn(BATCH, c, 32)  # UNet1D's mid block pads what 3 halvings leave
    return torch.randn(BATCH, c, SIDE, SIDE)


def _input(p: str, name: str, cfg, params) -> object:
    """An example value for forward parameter ``p``, or ``inspect.Parameter.empty`` to leave it."""
    if p in INPUTS.get(name, {}):
        return INPUTS[name][p]()
    required = params[p].default is inspect.Parameter.empty
    tokens = "img_ids" in params or "img_shapes" in params
    if p in ("hidden_states", "sample", "x"):
        return _latent(name, cfg, tokens)
    if p in ("encoder_hidden_states", "cap_feats", "text_bth", "encoder_hidden_states_t5"):
        return torch.randn(BATCH, TEXT_TOKENS, TEXT_DIM)
    if p == "image_embeds" and (required or cfg.get("image_embed_dim")):
        return torch.randn(BATCH, TEXT_TOKENS, TEXT_DIM)  # nonzero: HunyuanVideo15 reads 0 as t2v
    if p == "encoder_hidden_states_2" and cfg.get("text_embed_2_dim"):
        return torch.randn(BATCH, TEXT_TOKENS, TEXT_DIM)
    if p == "encoder_attention_mask_2" and cfg.get("text_embed_2_dim"):
        return torch.ones(BATCH, TEXT_TOKENS)
    if p in ("pooled_projections", "pooled_embeds"):
        return torch.randn(BATCH, TEXT_DIM)
    if p in ("timestep", "timesteps", "t") or (required and p in ("timestep_r", "r_timestep")):
        return torch.tensor([0.3, 0.7])
    if p == "text_lens":
        return torch.full((BATCH,), TEXT_TOKENS)
    if p == "img_shapes":  # per sample, per image: (frames, height, width) in latent tokens
        return [[(1, SIDE // 2, SIDE // 2)]] * BATCH
    if p == "guidance" and cfg.get("guidance_embeds"):
        return torch.tensor([3.5, 3.5])
    if p == "class_labels" and cfg.get("num_class_embeds", 0) is not None:
        return torch.zeros(BATCH, dtype=torch.long)
    if p in ("encoder_attention_mask", "encoder_hidden_states_mask"):
        return torch.ones(BATCH, TEXT_TOKENS)
    if p in ("original_size", "target_size", "crop_coords"):
        return torch.tensor([[SIDE, SIDE]] * BATCH, dtype=torch.float)
    if p in ("img_ids", "txt_ids"):
        axes = len(cfg.get("axes_dims_rope") or (0, 0, 0))
        return torch.zeros(SIDE * SIDE // 4 if p == "img_ids" else TEXT_TOKENS, axes)
    return inspect.Parameter.empty


def example_arguments(model: nn.Module) -> tuple[list[str], tuple]:
    """The forward parameters given and their example tensors."""
    name, params = type(model).__name__, inspect.signature(model.forward).parameters
    cfg = next(m.config for m in model.modules() if hasattr(m, "config"))  # Dual: its first half's
    names, values = [], []
    for p, param in params.items():
        value = _input(p, name, cfg, params)
        if value is inspect.Parameter.empty:
            if param.default is inspect.Parameter.empty and param.kind not in (
                    param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"no example input for required forward argument {p!r}")
            continue
        names.append(p)
        values.append(value)
    return names, tuple(values)


class Wrapped(nn.Module):
    """``model(**dict(zip(names, inputs)), **fixed, return_dict=False)``'s first tensor: the
    tensors are the inputs, the other arguments (shapes as Python lists) are fixed. A class of
    ``UNBATCHED`` gets those inputs as lists of per-sample tensors and its output list stacked."""

    def __init__(self, model: nn.Module, names: list[str], inputs: tuple, fixed: dict):
        super().__init__()
        self.model, self.names, self.inputs, self.fixed = model, names, inputs, fixed
        self.return_dict = "return_dict" in inspect.signature(model.forward).parameters
        self.unbatched = UNBATCHED.get(type(model).__name__, ())

    def forward(self, *inputs):
        kwargs = {n: list(v.unbind(0)) if n in self.unbatched else v
                  for n, v in zip(self.names, inputs)}
        kwargs.update(self.fixed)
        out = self.model(**kwargs, return_dict=False) if self.return_dict else self.model(**kwargs)
        while not isinstance(out, torch.Tensor):
            if isinstance(out, list) and all(isinstance(o, torch.Tensor) for o in out):
                return torch.stack(out)
            out = out[0] if isinstance(out, (tuple, list)) else out.sample
        return out
