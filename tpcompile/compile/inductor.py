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
  so tests and benchmarks can check them against what the plan promised; a repeated block
  compiled once as a compiled block (runtime/compiled_blocks.py) counts once per call
  (:func:`subgraph_calls`).
"""

from __future__ import annotations

import re

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

__all__ = ["OVERLAP_DEFAULT", "OVERLAP_PASSES", "COMPILED_BLOCKS_WORKAROUND",
           "REGIONS_WORKAROUND", "compile_options",
           "calls_compiled_blocks", "dynamic_dims", "mark_dynamic",
           "collective_kind", "collectives_in_code", "subgraph_calls"]

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


# torch 2.13's inductor with buffer reuse on gives wrong gradients for a backward through
# compiled blocks of a TP model (every gradient off by 1-50% on the 2-block Llama; the forward
# is right, aot_eager and the min-cut partition alone are right): compiled blocks need it off.
COMPILED_BLOCKS_WORKAROUND = {"allow_buffer_reuse": False}
REGIONS_WORKAROUND = COMPILED_BLOCKS_WORKAROUND  # its name before 'region' meant checkpoints only


def compile_options(overlap: bool | None = None, compiled_blocks: bool = False,
                    regions: bool = False) -> dict:
    """Inductor options for compiling a tensor-parallel graph (``torch.compile(options=...)``).

    Args:
        overlap: reorder collectives for communication/computation overlap; None takes
            ``OVERLAP_DEFAULT``, the setting the benchmark measured faster.
        compiled_blocks: the graph runs repeated blocks as compiled blocks (calls of one
            ``torch.compiler.nested_compile_region``, ``tp.compiled_blocks = True``): turns
            off inductor's buffer reuse, which torch 2.13 gets wrong there
            (``COMPILED_BLOCKS_WORKAROUND``).
        regions: the same as ``compiled_blocks`` (its documented former name).
    """
    if overlap is None:
        overlap = OVERLAP_DEFAULT
    out = dict(COMPILED_BLOCKS_WORKAROUND) if compiled_blocks or regions else {}
    if overlap:
        out.update({"reorder_for_compute_comm_overlap": True,
                    "reorder_for_compute_comm_overlap_passes": list(OVERLAP_PASSES)})
    return out


def calls_compiled_blocks(gm: torch.fx.GraphModule) -> bool:
    """``gm`` (a Dynamo graph) calls a compiled block (a nested compile region's body)."""
    return any(n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph
               for n in gm.graph.nodes)


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


# a nested compile region's body, emitted once: ``def partitioned_fw_subgraph_0_0(args):``
_SUBGRAPH_DEF = re.compile(r"^def (\w*subgraph\w*)\(args\):\n((?:[ \t]+.*\n|\n)*)", re.MULTILINE)


def subgraph_calls(code: str) -> dict[str, int]:
    """``{body: calls}`` for each nested compile region body of one generated module.

    A region's body is generated once, as a function, and called once per repeated block:
    ``{"partitioned_fw_subgraph_0_0": 16}`` means sixteen blocks ran one compiled body.
    """
    bodies = {m.group(1) for m in _SUBGRAPH_DEF.finditer(code)}
    outside = _SUBGRAPH_DEF.sub("", code)
    return {b: len(re.findall(rf"= {b}\(", outside)) for b in sorted(bodies)}


def collectives_in_code(code: str) -> dict[str, int]:
    """``{kind: count}`` of the collectives one call of a generated module issues (waits excluded).

    Collectives inside a nested compile region's body count once per call of that body.
    """
    bodies = {m.group(1): m.group(2) for m in _SUBGRAPH_DEF.finditer(code)}
    calls = subgraph_calls(code)
    counts: dict[str, int] = {}
    for text, times in [(_SUBGRAPH_DEF.sub("", code), 1)] + [
            (body, calls[name]) for name, body in bodies.items()]:
        for kind in filter(None, map(collective_kind, _CALL.findall(text))):
            counts[kind] = counts.get(kind, 0) + times
    return counts
