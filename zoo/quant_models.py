"""Weight-only quantized Llamas as users write them: gpt-fast's int8 and int4 linears, torchao's.

``Int8Linear`` is gpt-fast's ``WeightOnlyInt8Linear``: an int8 ``weight`` buffer (out, in) and
float per-output-channel ``scales``, ``F.linear(x, weight.to(x.dtype)) * scales``.
``Int4Linear`` keeps gpt-fast's group-wise ``scales_and_zeros`` (in / group, out, 2) and its
dequantization ``(w - 8) * scale + zero``, but packs two 4-bit values per byte along the input
dim in a plain uint8 (out, in / 2) buffer and unpacks them with shifts and masks, as gpt-fast's
CPU fallback would: ``_weight_int4pack_mm``'s tiled layout is opaque to a planner. Both are
quantized from the built-in Llama with 4 kv heads, like torchao's ``Int8WeightOnlyConfig`` (so 2 and 4 ranks both split k and v);
every block linear is quantized, the embedding and the LM head stay float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcompile.tools import models

LLAMA_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
GROUP = 16  # int4 group size along the input dim


class Int8Linear(nn.Module):
    """gpt-fast's weight-only int8 linear: symmetric per-output-channel scales."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(w.dtype))

    def forward(self, x):
        return F.linear(x, self.weight.to(dtype=x.dtype)) * self.scales


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit weights, two per byte along the input dim."""

    def __init__(self, linear: nn.Linear, group: int = GROUP):
        super().__init__()
        w = linear.weight.detach()
        out, k = w.shape
        g = w.view(out, k // group, group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scales = ((hi - lo) / 15).clamp(min=1e-6)
        zeros = lo + scales * 8
        q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.view(out, k // 2, 2)
        self.register_buffer("weight", (q[..., 0] << 4) | q[..., 1])
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1)
                             .contiguous())
        self.group = group

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        out, half = self.weight.shape
        w = torch.stack([self.weight >> 4, self.weight & 15], dim=-1).view(out, 2 * half)
        scales, zeros = self.scales_and_zeros.unbind(-1)  # (in / group, out) each
        w = w.to(dtype).view(out, -1, self.group)
        w = (w - 8) * scales.t().unsqueeze(-1) + zeros.t().unsqueeze(-1)
        return w.view(out, 2 * half)

    def forward(self, x):
        return F.linear(x, self.dequantize(x.dtype))


def quantized(model: nn.Module, kind: str, group: int = GROUP) -> nn.Module:
    """``model`` with every block linear replaced by ``kind``'s (``int8``, ``int4`` with
    ``group``) in place."""
    def convert(linear):
        return Int8Linear(linear) if kind == "int8" else Int4Linear(linear, group)

    for name, module in list(model.named_modules()):
        owner, _, leaf = name.rpartition(".")
        if leaf in LLAMA_LINEARS and isinstance(module, nn.Linear):
            setattr(model.get_submodule(owner), leaf, convert(module))
    return model.requires_grad_(False)


def torchao_int8(model: nn.Module) -> nn.Module:
    """torchao's ``quantize_(model, Int8WeightOnlyConfig())`` on the block linears (their
    weights become ``Int8Tensor`` subclass parameters)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    def block_linear(module, fqn):
        return isinstance(module, nn.Linear) and fqn.rpartition(".")[2] in LLAMA_LINEARS

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=block_linear)
    return model.requires_grad_(False)


# torchao 0.18's inference configs on a Hugging Face Llama's block linears (group-wise ones in
# groups of ``group`` input features); the last two quantize activations per token as well
TORCHAO = ("int8_weight_only", "intx_weight_only", "float8_weight_only",
           "int8_dynamic_int8", "int8_dynamic_intx")
DYNAMIC = ("int8_dynamic_int8", "int8_dynamic_intx")


def torchao_config(name: str, group: int = 32):
    """The torchao config ``name`` of :data:`TORCHAO` stands for (intx: int4 in ``group``s)."""
    import torchao.quantization as q
    from torchao.quantization.granularity import PerGroup

    return {"int8_weight_only": lambda: q.Int8WeightOnlyConfig(),
            "intx_weight_only": lambda: q.IntxWeightOnlyConfig(
                weight_dtype=torch.int4, granularity=PerGroup(group)),
            "float8_weight_only": lambda: q.Float8WeightOnlyConfig(),
            "int8_dynamic_int8": lambda: q.Int8DynamicActivationInt8WeightConfig(),
            "int8_dynamic_intx": lambda: q.Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=PerGroup(group))}[name]()


def torchao_blocks(model: nn.Module, name: str, group: int = 32, frozen: bool = True) -> nn.Module:
    """``quantize_(model, torchao_config(name, group))`` on every linear inside the repeated
    blocks (``layers.``: the embedding and LM head stay float); ``frozen``: every parameter
    left stops requiring grad too (norms, embeddings)."""
    from torchao.quantization import quantize_

    def block_linear(module, fqn):
        return isinstance(module, nn.Linear) and "layers." in fqn

    quantize_(model, torchao_config(name, group), filter_fn=block_linear)
    return model.requires_grad_(False) if frozen else model


def build(kind: str, group: int = GROUP) -> tuple[nn.Module, tuple]:
    """(the built-in Llama with 4 kv heads quantized as ``kind``, its example inputs):
    ``int8``, ``int4`` (groups of ``group`` input features) or ``torchao_int8``."""
    model = models.build("llama", n_kv_heads=4).eval()
    inputs = models.example_inputs(model)
    if kind == "torchao_int8":
        return torchao_int8(model), inputs
    return quantized(model, kind, group), inputs


def subclass_part_names(model: nn.Module) -> list[str]:
    """Names of the buffers a sharded module stores for torchao's subclass weights (``weight``
    -> ``weight_qdata``, ``weight_scale``, ``weight_zero_point``)."""
    return [n for n, _ in model.named_buffers() if n.rpartition(".")[2].startswith("weight_")]


def quantized_names(model: nn.Module) -> list[str]:
    """Names of the integer weight buffers (the tensors weight-only quantization shrinks) of a
    model or of its sharded module (where torchao's ``weight`` is ``weight_qdata``)."""
    return [n for n, t in model.named_buffers()
            if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)]
