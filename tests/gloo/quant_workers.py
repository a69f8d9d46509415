"""Rank-side bodies of ``test_quant.py``: weight-only quantized Llamas on gloo ranks.

``quant``: each case parallelizes a model from ``zoo/quant_models.py`` and runs it under
``torch.no_grad`` beside the unsharded quantized model: the outputs, the forward collectives,
the bytes of integer weights this rank stores, and the full state gathered back.
``generation``: gpt-fast's static-cache decoder (``zoo/cache_models.py``) quantized, greedy
tokens of the sharded and the unsharded model. ``torchao``: torchao's inference configs on a
tiny Hugging Face Llama, parallelized under ``torch.no_grad``: outputs, collectives beside the
float model's, ``generate``'s tokens, the bytes of the quantized parts and a call with grad
enabled (refused where the capture is inference-only).
"""

from __future__ import annotations

import math
import traceback

import torch

import tpcompile
from tpcompile.runtime.collectives import count_collectives
from tpcompile.tools.numerics import rel_err
from zoo import quant_models
from tpcompile.errors import TPCompileError
from zoo.cache_models import CachedDecoder, greedy
from zoo.hf_models import hf_causal_lm, hf_prompt


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _case(kind: str) -> dict:
    model, inputs = quant_models.build(kind)
    tp = tpcompile.parallelize(model, inputs)
    with torch.no_grad():
        out, ref = tp(*inputs), model(*inputs)
    names = quant_models.quantized_names(tp)
    local, full = dict(tp.named_buffers()), tp.full_state_dict()
    return {
        "output_err": rel_err(out, ref), "bit_exact": torch.equal(out, ref),
        "collectives": count_collectives(tp.graph_module)["forward"],
        "int_bytes": _nbytes(local[n] for n in names),
        "int_bytes_total": _nbytes(full[n] for n in names),
        "state_mismatches": sorted(n for n, t in model.state_dict().items()
                                   if n in full and not torch.equal(full[n], t)),
        "styles": {n: tp.plan.by_fqn[n].style for n in names},
    }


def _each(case, kinds: list[str]) -> dict:
    """kind -> ``case(kind)``, or the traceback it raised (reported per case by the test)."""
    out = {}
    for kind in kinds:
        try:
            out[kind] = case(kind)
        except Exception:  # noqa: BLE001
            out[kind] = {"error": traceback.format_exc()}
    return out


def quant(rank: int, world_size: int, kinds: list[str]) -> dict:
    return _each(_case, kinds)


PROMPT, NEW = 8, 12


def _generation_case(kind: str) -> dict:
    torch.manual_seed(0)
    model = quant_models.quantized(CachedDecoder(kv_heads=4), kind)
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tp = tpcompile.parallelize(model, (prompt, torch.arange(PROMPT)))
    names = quant_models.quantized_names(tp)
    local, full = dict(tp.named_buffers()), tp.full_state_dict()
    return {"tokens": greedy(tp, prompt, NEW).tolist(), "want": greedy(model, prompt, NEW).tolist(),
            "int_bytes": _nbytes(local[n] for n in names),
            "int_bytes_total": _nbytes(full[n] for n in names)}


def generation(rank: int, world_size: int, kinds: list[str]) -> dict:
    return _each(_generation_case, kinds)


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _torchao_case(name: str, group: int, generate: bool) -> dict:
    """torchao's ``name`` config on a tiny HF Llama's blocks, beside the unsharded quantized
    model: outputs, forward collectives, greedy tokens (``generate``: two more captures), the
    bytes of the subclass weights' parts this rank stores (and unsharded, from the plan's
    global shapes), their plans, and a call with grad enabled."""
    model = quant_models.torchao_blocks(hf_causal_lm("llama").eval(), name, group, frozen=False)
    ids, mask = hf_prompt()
    with torch.no_grad():  # inference only: dynamic activation quantization rounds in a Function
        tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
        out, ref = (_logits(m(ids, attention_mask=mask)) for m in (tp, model))
        want = (model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
                if generate else None)
    local, plans = dict(tp.named_buffers()), tp.plan.by_fqn
    names = quant_models.subclass_part_names(tp)
    try:
        tp(ids, attention_mask=mask)  # grad enabled, norms trainable: a backward could follow
        training = ""
    except TPCompileError as e:
        training = f"{type(e).__name__}: {e}"
    return {
        "output_err": rel_err(out, ref), "collectives": count_collectives(tp.graph_module)["forward"],
        "tokens": tp.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                              do_sample=False).tolist() if generate else None,
        "want": want.tolist() if generate else None,
        "part_bytes": _nbytes(local[n] for n in names),
        "part_bytes_total": sum(math.prod(plans[n].global_shape) * local[n].element_size()
                                for n in names),
        "plans": {n: (plans[n].style, plans[n].reason) for n in names},
        "training": training, "inference_only": tp.plan.inference_only,
    }


def torchao(rank: int, world_size: int, names: list[str], group: int,
            generating: list[str]) -> dict:
    """name -> :func:`_torchao_case` (int4 weights in ``group``s; the names in ``generating``
    generate too)."""
    return _each(lambda name: _torchao_case(name, group, name in generating), names)
