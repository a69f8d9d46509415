"""Rank-side bodies of ``test_bf16.py``: a Llama trained in bfloat16 at 2 ranks against the
unsharded model in the same precision.

Every run starts from the same weights and trains on the same batches (AdamW, :data:`STEPS`
steps); each returns its per-step losses:

- ``ref``: the unsharded model with bfloat16 parameters;
- ``reordered``: the same, with every linear computed as two bfloat16 matmuls over the halves
  of its input features, added (the order of a 2-rank row-parallel linear: each rank's partial
  sum is rounded to bfloat16, then the two are added). The control: what reordering partial
  sums alone, with no tensor parallelism, does to this training curve;
- ``tp``: ``parallelize`` of the bfloat16 model; ``compiled``: that ``TPModule`` through
  ``torch.compile(fullgraph=True)``, against the unsharded model compiled the same way
  (``ref_compiled``): inductor computes bfloat16 pointwise ops in float32 and rounds once
  per fused kernel, another precision than eager's;
- ``autocast_tp`` / ``autocast_ref``: the float32 model under ``torch.autocast("cpu",
  bfloat16)``, sharded and not.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import tpcompile
from tpcompile.tools import models

CFG = dict(dim=32, hidden=64, n_layers=2, vocab=64)
BATCH, SEQ, STEPS, LR = 8, 16, 50, 3e-3
N_BATCHES = 4  # cycled: the model can learn them, so the loss falls over the 50 steps


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    data = [torch.randint(0, CFG["vocab"], (BATCH, SEQ), generator=torch.Generator().manual_seed(i))
            for i in range(N_BATCHES)]
    return [data[i % N_BATCHES] for i in range(steps)]


def train(model, steps: int = STEPS, autocast: bool = False) -> list[float]:
    """Per-step losses (cross-entropy in float32) of ``steps`` AdamW steps of ``model``."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens in batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, CFG["vocab"]),
                               tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class ReorderedLinears(TorchFunctionMode):
    """Every ``F.linear`` as the sum of two matmuls over the halves of its input features."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, bias = (list(args) + [kwargs.get("bias")])[:3]
        k = weight.shape[1] // 2
        y = F.linear(x[..., :k], weight[:, :k]) + F.linear(x[..., k:], weight[:, k:])
        return y if bias is None else y + bias


def _compiled(module):
    return torch.compile(module, fullgraph=True, options=tpcompile.compile_options())


def _run(name: str, model) -> list[float]:
    """The losses of run ``name`` (module docstring) from a copy of ``model`` (float32)."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    example = (batches(1)[0],)
    if name == "ref":
        return train(bf16)
    if name == "reordered":
        with ReorderedLinears():
            return train(bf16)
    if name == "ref_compiled":
        return train(_compiled(bf16))
    if name.startswith("autocast"):
        fp32 = copy.deepcopy(model)
        return train(tpcompile.parallelize(fp32, example) if name == "autocast_tp" else fp32,
                     autocast=True)
    tp = tpcompile.parallelize(bf16, example)
    return train(_compiled(tp) if name == "compiled" else tp)


def bf16_training(rank: int, world_size: int, names: list[str]) -> dict:
    model = models.build("llama", seed=3, **CFG)
    out = {}
    for name in names:
        torch.compiler.reset()
        try:
            out[name] = _run(name, model)
        except Exception:  # noqa: BLE001 - reported per run by the test
            out[name] = {"error": traceback.format_exc()}
    return out
