"""Rank-side bodies of ``test_quant.py``: weight-only quantized Llamas on gloo ranks.

``quant``: each case parallelizes a model from ``zoo/quant_models.py`` and runs it under
``torch.no_grad`` beside the unsharded quantized model: the outputs, the forward collectives,
the bytes of integer weights this rank stores, and the full state gathered back.
``generation``: gpt-fast's static-cache decoder (``zoo/cache_models.py``) quantized, greedy
tokens of the sharded and the unsharded model.
"""

from __future__ import annotations

import traceback

import torch

import tpcompile
from tpcompile.runtime.collectives import count_collectives
from tpcompile.tools.numerics import rel_err
from zoo import quant_models
from zoo.cache_models import CachedDecoder, greedy


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
