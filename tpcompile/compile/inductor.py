"""What tpcompile tells inductor, and how to read what inductor made of a tensor-parallel graph.

A :class:`~tpcompile.runtime.module.TPModule` compiles like any module: its graph is plain ATen plus
autograd Functions around ``torch.ops._c10d_functional``, which inductor lowers to the same
functional collectives (re-inplaced, e.g. ``all_reduce_``, each followed by ``wait_tensor``)::

    tp = tpcompile.parallelize(model, (tokens,))
    tpcompile.mark_dynamic(tp, tokens)      # batch / sequence symbolic from the first compile
    step = torch.compile(tp, fullgraph=True, options=tpcompile.compile_options())

Three things live here:

* :func:`compile_options`: inductor config for communication/computation overlap. Inductor's
  default scheduler waits for every collective right after issuing it; the reorder passes sink
  the backward's ``wait_tensor`` past the weight-gradient matmuls that do not need the reduced
  value, so those run while the all-reduce is in flight. Whether that pays depends on the
  transport: ``OVERLAP_DEFAULT`` follows what ``bench/step_time.py`` measured
  (docs/performance.md: no gain on CPU/gloo, so off).
* :func:`mark_dynamic`: the capture exports every input dim as ``Dim.AUTO``, so the graph
  already knows which dims are free (batch, sequence). Marking them before the first call
  makes Dynamo compile one graph for all their sizes >= 2 instead of recompiling (first
  static, then once per dim that changes). A size of 1 is still specialised by Dynamo
  (one extra graph for each dim that takes the value 1).
* :func:`collectives_in_code`: the collectives of inductor's generated wrapper code, by kind,
  so tests and benchmarks can check them against what the plan promised.
"""

from __future__ import annotations

import re

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

__all__ = ["OVERLAP_DEFAULT", "OVERLAP_PASSES", "compile_options", "dynamic_dims", "mark_dynamic",
           "collective_kind", "collectives_in_code"]

# Inductor's scheduler passes (torch/_inductor/comms.py), the list its config recommends: move
# each collective early and each wait late, as far as peak memory allows.
OVERLAP_PASSES = ("reorder_communication_preserving_peak_memory", "sink_waits_iterative",
                  "reorder_communication_preserving_peak_memory")

# bench/step_time.py on CPU/gloo (docs/performance.md; bench/results/): in four runs (Llama at
# 2 and 4 ranks, GPT-2 at 2, a 60-step Llama A/B) overlap-on / overlap-off step time was
# 0.95-1.12, while an identical overlap-off variant measured 0.99-1.11: no gain beyond noise
# (gloo's all-reduce competes for the same cores), so inductor's default order stays. Not
# measured on GPUs, where NCCL runs on its own stream: try overlap=True there.
OVERLAP_DEFAULT = False


def compile_options(overlap: bool | None = None) -> dict:
    """Inductor options for compiling a tensor-parallel graph (``torch.compile(options=...)``).

    Args:
        overlap: reorder collectives for communication/computation overlap; None takes
            ``OVERLAP_DEFAULT``, the setting the benchmark measured faster.
    """
    if overlap is None:
        overlap = OVERLAP_DEFAULT
    if not overlap:
        return {}
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": list(OVERLAP_PASSES)}


def dynamic_dims(tp) -> tuple[tuple[int, ...], ...]:
    """Per tensor input of ``tp``'s graph: the dims its capture kept symbolic."""
    out = []
    for node in tp.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.append(tuple(d for d, s in enumerate(v.shape) if not is_concrete_int(s)))
    return tuple(out)


def mark_dynamic(tp, *inputs) -> None:
    """Mark the symbolic dims of ``inputs`` (the first call's tensors) for ``torch.compile``.

    Call it once, on the tensors of the first compiled call; later calls with other batch sizes
    or sequence lengths (>= 2) then reuse the same graph.
    """
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    dims = dynamic_dims(tp)
    if len(tensors) != len(dims):
        raise ValueError(f"expected {len(dims)} tensor inputs (as captured), got {len(tensors)}")
    for x, d in zip(tensors, dims):
        if d:
            torch._dynamo.mark_dynamic(x, d)


# one call per line of the wrapper: [bufN = ]torch.ops._c10d_functional.all_reduce_.default(...
_CALL = re.compile(r"^\s*(?:\w+ = )?torch\.ops\._c10d_functional\.(\w+)\.default\(", re.MULTILINE)
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collective_kind(op: str) -> str | None:
    """``all_reduce_`` / ``all_gather_into_tensor_out`` / ... -> its kind; None for waits etc."""
    return next((k for k in _KINDS if op.startswith(k)), None)


def collectives_in_code(code: str) -> dict[str, int]:
    """``{kind: count}`` of the collectives issued by one generated module (waits excluded)."""
    counts: dict[str, int] = {}
    for kind in filter(None, map(collective_kind, _CALL.findall(code))):
        counts[kind] = counts.get(kind, 0) + 1
    return counts
