"""Rank-side bodies of ``test_lora.py``: frozen weights and LoRA adapters on gloo ranks.

Each case parallelizes a model from ``zoo/lora_models.py``, compares its outputs and every
gradient with the unsharded model, trains both for 3 AdamW steps and compares the merged
weights (base + B @ A * scale; peft's ``merge_and_unload``) rebuilt from the gathered state.
"""

from __future__ import annotations

import copy
import math
import traceback

import torch

import tpcompile
from tpcompile.tools.numerics import compare, rel_err
from zoo import lora_models


def _lora_case(name: str, rank: int) -> dict:
    model, inputs, kwargs, _ = lora_models.build(name)
    tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs or None)
    cmp = compare(model, tp, inputs, steps=3, kwargs=kwargs, keep_state=True)
    loaded = copy.deepcopy(cmp.reference)
    missing = loaded.load_state_dict(cmp.full_state, strict=False).missing_keys
    mine, theirs = lora_models.merged(loaded), lora_models.merged(cmp.reference)
    bases = [base for base, _, _ in lora_models.adapters(model).values()]
    return {
        "output_err": cmp.output_err, "grad_errs": cmp.grad_errs, "step_errs": cmp.step_errs,
        "merged_errs": {k: rel_err(mine[k], t) for k, t in theirs.items()},
        "missing_after_load": missing,
        "with_grad": sorted(n for n, p in tp.named_parameters() if p.grad is not None),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "collectives": cmp.collectives,
        "base_share": {n: math.prod(tp.plan.params[n].local_shapes[rank])
                       / math.prod(tp.plan.params[n].global_shape) for n in bases},
    }


def _frozen_case(rank: int) -> dict:
    """The tiny HF Llama frozen, run under ``torch.no_grad`` (inference as users run it)."""
    model = lora_models.hf_llama().requires_grad_(False)
    inputs, kwargs = lora_models.hf_inputs(model)
    tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs)
    with torch.no_grad():
        out, ref = tp(*inputs, **kwargs).logits, model(*inputs, **kwargs).logits
    return {"output_err": rel_err(out, ref), "requires_grad": out.requires_grad,
            "styles": tp.plan.styles(), "grad_syncs": dict(tp.plan.grad_syncs),
            "local_shapes": {n: tuple(p.shape) for n, p in tp.named_parameters()}}


def lora(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = _frozen_case(rank) if name == "frozen" else _lora_case(name, rank)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
    return out
