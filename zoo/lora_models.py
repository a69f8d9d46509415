"""LoRA as users write it: a hand-written adapter and peft's, on tiny random-init models.

``LoRALinear`` is ``y = base(x) + B(A(x)) * scale`` with the base frozen; ``peft`` wraps a
Hugging Face Llama's linears in its own ``LoraLayer``. Both adapters start random (not ``B =
0``), so that ``A`` gets a gradient from the first step and the checks are not vacuous.
Every builder returns the model, its example inputs and keyword inputs, and the frozen base
model it adapts (for the plan it must match).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tpcompile.tools import models
from zoo import hf_models

RANK, ALPHA = 4, 8.0
LLAMA_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update: ``base(x) + B(A(x)) * scale``."""

    def __init__(self, base: nn.Linear, rank: int = RANK, alpha: float = ALPHA):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def with_lora(model: nn.Module, targets: tuple[str, ...]) -> nn.Module:
    """``model`` frozen, with every ``nn.Linear`` whose attribute name is in ``targets``
    replaced by a :class:`LoRALinear` around it (in place; returns ``model``)."""
    model.requires_grad_(False)
    torch.manual_seed(1)
    for name, module in list(model.named_modules()):
        owner, _, leaf = name.rpartition(".")
        if leaf in targets and isinstance(module, nn.Linear):
            setattr(model.get_submodule(owner), leaf, LoRALinear(module))
    return model


def hf_llama() -> nn.Module:
    """The suite's tiny Hugging Face Llama (2 layers, 8 query / 2 KV heads, hidden 64)."""
    return hf_models.hf_model("llama").eval()


def hf_inputs(model) -> tuple[tuple, dict]:
    ids, kwargs = hf_models.hf_inputs(model)
    return (ids,), kwargs


def build(name: str) -> tuple[nn.Module, tuple, dict, nn.Module]:
    """(model with adapters, inputs, keyword inputs, the frozen base model) for case ``name``:
    ``llama`` (tpcompile's built-in Llama, every block linear adapted by hand), ``peft_qv``
    (peft on q_proj and v_proj of the HF Llama) or ``peft_all`` (peft on every linear)."""
    if name == "llama":
        base = models.build("llama").requires_grad_(False)
        inputs = models.example_inputs(base)
        return with_lora(copy.deepcopy(base), LLAMA_LINEARS), inputs, {}, base
    import peft

    base = hf_llama().requires_grad_(False)
    inputs, kwargs = hf_inputs(base)
    targets = {"peft_qv": ["q_proj", "v_proj"], "peft_all": "all-linear"}[name]
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                             task_type="CAUSAL_LM", init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(copy.deepcopy(base), config), inputs, kwargs, base


def adapters(model: nn.Module) -> dict[str, tuple[str, str, str]]:
    """Module path -> FQNs of (base weight, A weight, B weight) of every adapted linear,
    hand-written or peft's."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            out[name] = tuple(f"{name}.{k}.weight" for k in ("base", "lora_A", "lora_B"))
        elif hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), nn.ModuleDict):
            out[name] = tuple(f"{name}.{k}.weight" for k in
                              ("base_layer", "lora_A.default", "lora_B.default"))
    return out


def base_fqn(path: str) -> str:
    """The FQN in the unadapted model of the weight an adapter at ``path`` wraps (peft nests
    the model under ``base_model.model``)."""
    return path.removeprefix("base_model.model.") + ".weight"


def merged(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights a deployment runs: peft's ``merge_and_unload`` on a copy, or ``base + B @ A
    * scale`` of each hand-written adapter."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload().state_dict()
    return {f"{name}.weight": (m.base.weight + m.lora_B.weight @ m.lora_A.weight * m.scale).detach()
            for name, m in model.named_modules() if isinstance(m, LoRALinear)}
