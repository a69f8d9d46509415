"""Run each activation-checkpointed region of a rank's graph through ``torch.utils.checkpoint``.

A region is a set of the graph's ops whose activations are recomputed in backward instead of
saved: a ``torch.utils.checkpoint.checkpoint`` call of the model (marked at capture,
:mod:`tpcompile.core.checkpoint_marks`), or with ``activation_checkpointing="full"`` or
``"selective"`` one call of a repeated block (``layers.3``, :mod:`tpcompile.core.block_paths`).
The planner and the rewrite keep each captured node's mark; a node the passes inserted (a
collective, a slice of a weight) has none and joins the region of its inputs, or else of its
users, when they agree on one. So the collectives of a region run inside it and run again
when its recomputation reaches them, as in Megatron's full recompute (torch stops a
recomputation once backward has what it reads): every rank recomputes the same regions in the
same order. ``"selective"`` saves the outputs of :data:`SAVED_OPS` (matmuls, attention, collectives) and
recomputes the rest, through ``create_selective_checkpoint_contexts``.

:func:`checkpointed_graph` outlines each region into a function of its inputs (activations,
parameters, sizes: the parameters stay ``get_attr`` nodes of the outer graph, so their names do
not change) called through ``checkpoint(..., use_reentrant=False)``. A region that cannot be
outlined (it is not convex: an outside op reads one of its values and feeds another of its
ops; or it writes a tensor in place, which a recomputation would write again) stays inline, and
is reported with the reason; the result is always the same computation.

:func:`checkpoint_regions_pass` is the pipeline's step (``OUTLINE_PASSES`` in
``passes/pipeline.py``): it runs after the ranks agree on the rewritten graph, whose
collectives an outlined region would hide inside its call.
"""

from __future__ import annotations

import functools
import heapq
import operator
from collections import defaultdict

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from tpcompile.core.block_paths import block_of, repeated_block_paths
from tpcompile.core.checkpoint_marks import REGION

__all__ = ["MODES", "regions_of", "outlinable_regions", "checkpointed_graph",
           "checkpoint_regions_pass"]

MODES = (None, "full", "selective")  # activation_checkpointing values parallelize accepts
_ATEN, _C10D = torch.ops.aten, torch.ops._c10d_functional
# "selective": what a block's recomputation reads back instead of computing again: the
# matmuls' and attentions' outputs (the expensive ops) and every collective's (so backward
# communicates no more than without checkpointing); the rest (norms, activations, adds,
# views) is recomputed
SAVED_OPS = [_ATEN.mm.default, _ATEN.addmm.default, _ATEN.bmm.default,
             _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
             _ATEN._scaled_dot_product_efficient_attention.default,
             _ATEN._scaled_dot_product_flash_attention.default,
             _ATEN._scaled_dot_product_cudnn_attention.default,
             _C10D.all_reduce.default, _C10D.all_gather_into_tensor.default,
             _C10D.reduce_scatter_tensor.default, _C10D.wait_tensor.default]


def _given_regions(gm: fx.GraphModule, mode: str | None) -> dict[fx.Node, str | None]:
    """The region each captured op was traced in (None: outside); inserted ops are absent."""
    if mode in ("full", "selective"):
        paths = repeated_block_paths(gm)
        return {n: block_of(n, paths) for n in gm.graph.nodes
                if n.op == "call_function" and "nn_module_stack" in n.meta}
    return {n: n.meta[REGION] for n in gm.graph.nodes
            if n.op == "call_function" and REGION in n.meta}


def _agreed(regions) -> str | None:
    """The one region all of ``regions`` name (None if they name none or several)."""
    named = {r for r in regions if r is not None}
    return named.pop() if len(named) == 1 else None


def regions_of(gm: fx.GraphModule, mode: str | None = None) -> dict[str, list[fx.Node]]:
    """Region name -> its ops, in graph order (see the module docstring)."""
    given = _given_regions(gm, mode)
    if not any(given.values()):
        return {}
    region = dict(given)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in ops:  # inserted ops: the region of their inputs ...
        if node not in given:
            region[node] = _agreed(region.get(a) for a in node.all_input_nodes)
    for node in reversed(ops):  # ... or else of their users, when every user is in one
        if node not in given and region[node] is None and all(u in region for u in node.users):
            region[node] = _agreed(region[u] for u in node.users)
    out: dict[str, list[fx.Node]] = defaultdict(list)
    for node in ops:
        if region[node] is not None:
            out[region[node]].append(node)
    return dict(out)


def _why_not_outlined(nodes: list[fx.Node], index: dict[fx.Node, int]) -> str | None:
    """Why a region cannot run as one call (None when it can)."""
    writes = [n for n in nodes if isinstance(n.target, torch._ops.OpOverload)
              and n.target._schema.is_mutable]
    if writes:
        return (f"it writes a tensor in place ({writes[0].name}: {writes[0].target}), which its "
                "recomputation in backward would write a second time")
    inside, last = set(nodes), index[nodes[-1]]
    downstream: set[fx.Node] = set()  # outside ops between its first and last op that read it
    for node in list(index)[index[nodes[0]]:last + 1]:
        if node in inside:
            continue
        if any(a in inside or a in downstream for a in node.all_input_nodes):
            if any(u in inside for u in node.users):
                return (f"{node.name} ({node.target}) is computed outside the region from its "
                        "values and read back inside it")
            downstream.add(node)
    return None


class _Region:
    """One region to outline: its ops, the values it reads from outside, those read outside."""

    def __init__(self, name: str, nodes: list[fx.Node]):
        self.name, self.nodes = name, nodes
        inside = set(nodes)
        self.inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                         if a not in inside))
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]

    def call(self, options: dict):
        """A function of the region's inputs that runs its ops under activation checkpointing
        (``options``: more keyword arguments of ``checkpoint``)."""
        graph = fx.Graph()
        env = {a: graph.placeholder(f"arg{i}") for i, a in enumerate(self.inputs)}
        for node in self.nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[n] for n in self.outputs))
        body = fx.GraphModule(torch.nn.Module(), graph, class_name="CheckpointedRegion")

        def checkpointed_region(*args):  # a plain function: FX's code refers to it as a global
            return checkpoint(body, *args, use_reentrant=False, **options)

        checkpointed_region.body = body  # its ops: runtime.blocks reads which block they are in
        return checkpointed_region


def _units_in_order(gm: fx.GraphModule, regions: list[_Region]) -> list:
    """The graph's nodes and regions (each one unit) in an order where every value is made
    before it is read: the graph's own order, a region where its inputs are all ready."""
    unit_of = {n: r for r in regions for n in r.nodes}
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    units = [n for n in gm.graph.nodes if n not in unit_of] + regions
    first = {u: index[u.nodes[0] if isinstance(u, _Region) else u] for u in units}
    needs = {u: {unit_of.get(a, a) for a in (u.inputs if isinstance(u, _Region)
                                              else u.all_input_nodes)} for u in units}
    readers = defaultdict(list)
    for u, deps in needs.items():
        for d in deps:
            readers[d].append(u)
    ready = [(first[u], id(u), u) for u in units if not needs[u]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, unit = heapq.heappop(ready)
        order.append(unit)
        for r in readers[unit]:
            needs[r].discard(unit)
            if not needs[r]:
                heapq.heappush(ready, (first[r], id(r), r))
    return order


def _options(mode: str | None) -> dict:
    """Full recomputation, or (``"selective"``) all but :data:`SAVED_OPS`. No ``context_fn``
    unless needed: torch.compile (2.13) refuses one given as a variable, even the default."""
    if mode == "selective":
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, SAVED_OPS)}
    return {}


def outlinable_regions(gm: fx.GraphModule, mode: str | None = None) -> tuple[list, list]:
    """``(regions that can be outlined, [(name, why not) for the others])``; ``explain``
    reports both without outlining."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions, dropped = [], []
    for name, nodes in regions_of(gm, mode).items():
        reason = _why_not_outlined(nodes, index)
        if reason is None:
            regions.append(_Region(name, nodes))
        else:
            dropped.append((name, reason))
    return regions, dropped


def checkpointed_graph(gm: fx.GraphModule, mode: str | None = None) -> tuple[list, list]:
    """Outline ``gm``'s regions (in place) into checkpointed calls.

    Returns ``(kept, dropped)``: the names of the regions now checkpointed, and
    ``(name, reason)`` for those left inline.
    """
    regions, dropped = outlinable_regions(gm, mode)
    if not regions:
        return [], dropped
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for unit in _units_in_order(gm, regions):
        if not isinstance(unit, _Region):
            env[unit] = graph.node_copy(unit, env.__getitem__)
            continue
        out = graph.call_function(unit.call(_options(mode)), tuple(env[a] for a in unit.inputs))
        for i, node in enumerate(unit.outputs):
            env[node] = graph.call_function(operator.getitem, (out, i))
            # the value only: no module stack, which would make the getitem look like an op of
            # the block to runtime.compiled_blocks (compiled blocks outline repeated blocks' ops)
            env[node].meta = {k: node.meta[k] for k in ("val", "tensor_meta") if k in node.meta}
    gm.graph = graph
    return [r.name for r in regions], dropped


def checkpoint_regions_pass(gm: fx.GraphModule,
                            checkpointing: str | None) -> tuple[PassResult, tuple[list, list]]:
    """:func:`checkpointed_graph` as a pass: ``checkpointing`` is ``parallelize``'s
    ``activation_checkpointing``; its ``(kept, dropped)`` are returned beside the graph (the
    pass record's ``facts``) for ``parallelize`` to keep and warn about."""
    kept, dropped = checkpointed_graph(gm, checkpointing)
    return PassResult(gm, bool(kept)), (kept, dropped)
