"""Example inputs of the diffusers sweep's tiny models (bench/diffusers_configs.py), read off
each class's forward signature, and the wrapper that runs the model on them.

Each forward parameter without a default (and the usual conditioning ones with one) is made
from its name (``_input``: latents by layout, text tokens 5 of width 32, timesteps, masks, ids,
shapes); ``INPUTS`` gives a class the arguments names cannot tell (packed sequences, index
tensors, channels-last latents), ``FRAMES_FIRST`` and ``UNBATCHED`` their layouts. Tensors
become the model's inputs; other arguments (shape lists, frame counts) are fixed in
``Wrapped``, which runs the model with ``return_dict=False`` and returns its first tensor.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

BATCH, TEXT_TOKENS, TEXT_DIM, SIDE = 2, 5, 32, 8
HEADS, HEAD_DIM = 2, 16

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
    "SanaWMLTX2RefinerTransformer3DModel": {  # 2 frames of video tokens, a timestep per token
        "hidden_states": lambda: torch.randn(BATCH, 2 * SIDE * SIDE, 8),
        "timestep": lambda: torch.rand(BATCH, 2 * SIDE * SIDE)},
    "WanAnimateTransformer3DModel": {  # latents (noisy, reference, mask: 2C + 4) on T + 1 frames
        "hidden_states": lambda: torch.randn(BATCH, 2 * 4 + 4, 3, SIDE, SIDE),
        "pose_hidden_states": lambda: torch.randn(BATCH, 4, 2, SIDE, SIDE),
        "face_pixel_values": lambda: torch.randn(BATCH, 3, 2, SIDE, SIDE)},
    "UNetMotionModel": {  # the text per frame (AnimateDiff's pipeline repeats it)
        "encoder_hidden_states": lambda: torch.randn(BATCH * 2, TEXT_TOKENS, TEXT_DIM)},
    "HiDreamImageTransformer2DModel": {  # latents it patchifies itself; a tapped Llama layer
        "hidden_states": lambda: torch.randn(BATCH, 4, SIDE, SIDE), "img_ids": lambda: None,
        # per block, of both kinds
        "encoder_hidden_states_llama3": lambda: torch.randn(4, BATCH, TEXT_TOKENS, TEXT_DIM)},
    "BriaFibo2Transformer2DModel": {  # the text's perceiver layer, then one per injection block
        "encoder_hidden_states": lambda: torch.randn(BATCH, 2, TEXT_TOKENS, TEXT_DIM)},
    "SanaWMTransformer3DModel": {"timestep": lambda: torch.rand(BATCH, 1, 2)},  # per frame
    "QwenImage21Transformer2DModel": {  # text slots, then image slots of 2x2 latent tokens each
        "img_mask": lambda: torch.arange(TEXT_TOKENS + SIDE * SIDE // 16).expand(BATCH, -1)
        >= TEXT_TOKENS},
}

# arguments a class's own helper makes from the model (its RoPE for given frame positions)
MODEL_INPUTS: dict[str, dict] = {
    "BriaFiboTransformer2DModel": {  # one text-encoder layer per block, of both kinds
        "text_encoder_layers": lambda m: torch.randn(
            m.config.num_layers + m.config.num_single_layers, BATCH, TEXT_TOKENS, TEXT_DIM)},
    "SanaWMLTX2RefinerTransformer3DModel": {
        "video_rotary_emb": lambda m: m.build_rotary_emb_for_absolute_positions(
            BATCH, [0, 1], SIDE, SIDE, torch.device("cpu"), 24.0)},
}

# arguments a forward takes as lists of tensors: the input, unbound along its first dimension
# (ZImage: per sample; BriaFibo: one text-encoder layer per transformer block)
UNBATCHED = {"ZImageTransformer2DModel": ("x", "cap_feats"),
             "BriaFiboTransformer2DModel": ("text_encoder_layers",)}

# video models whose latents are (batch, frames, channels, height, width)
FRAMES_FIRST = ("CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel",
                "AnyFlowTransformer3DModel", "AnyFlowFARTransformer3DModel",
                "UNetSpatioTemporalConditionModel")


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


def _input(p: str, model: nn.Module, cfg, params) -> object:
    """An example value for forward parameter ``p``, or ``inspect.Parameter.empty`` to leave it."""
    name = type(model).__name__
    if p in INPUTS.get(name, {}):
        return INPUTS[name][p]()
    if p in MODEL_INPUTS.get(name, {}):
        return MODEL_INPUTS[name][p](model)
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


def config_of(model: nn.Module):
    """``model``'s config; DualTransformer2DModel has none of its own: its first half's."""
    return next(m.config for m in model.modules() if hasattr(m, "config"))


def example_arguments(model: nn.Module) -> tuple[list[str], tuple]:
    """The forward parameters given and their example tensors."""
    params = inspect.signature(model.forward).parameters
    cfg = config_of(model)
    names, values = [], []
    for p, param in params.items():
        value = _input(p, model, cfg, params)
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
    ``UNBATCHED`` gets those inputs as lists of tensors and a list output stacked."""

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


def wrap(model: nn.Module) -> Wrapped:
    """``model`` with its example arguments: tensors as inputs, the rest fixed."""
    names, values = example_arguments(model)
    fixed = {n: v for n, v in zip(names, values) if not isinstance(v, torch.Tensor)}
    given = [(n, v) for n, v in zip(names, values) if n not in fixed]
    return Wrapped(model, [n for n, _ in given], tuple(v for _, v in given), fixed)
