"""Which replicated values need their gradient all-reduced (Megatron's *f*), and where.

A replicated value read by a sharded op gets, on each rank, only that rank's part of its
gradient: the parts must be summed over ranks before the value's own backward runs on. The
planner marks such values here (``grad_syncs``: value -> the consumers that make its gradient
partial); ``insert_collectives`` puts one ``copy_into_chain`` in front of those consumers, and
buckets the syncs of one block into one all-reduce. The sync moves up to where the sum can
be taken once (a fork into experts, say), never past a value two carriers make.

A root every rank holds whole (fewer kv heads than ranks: ``wk`` and ``wv`` whole everywhere)
read from a replicated input with no conversion is replicated for gradients too
(:func:`whole_roots`): each rank's gradient of ``k`` is partial (it attends with its own query
heads), so it is summed at ``k`` itself, in the same all-reduce as the input's own sync, and
the weight's gradient comes out whole. Summing the weight's gradient instead would cost a
second all-reduce per block (fewer bytes when a step has more tokens than the model width).
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.core.placement import Replicate, Shard, each
from tpcompile.passes.planner.dims import val
from tpcompile.passes.planner.propagate import Propagation
from tpcompile.passes.planner.rules import FRESH_BUFFERS

__all__ = ["values_with_grad", "grad_syncs", "copies_of_whole_chunks", "whole_shard",
           "partial_grads", "is_distributed", "whole_roots"]


def _floating(v) -> bool:
    """A floating (or complex: RoPE's rotation) tensor, or a multi-output op's list holding
    one (split, chunk, unbind)."""
    if isinstance(v, (list, tuple)):
        return any(_floating(x) for x in v)
    return isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)


def values_with_grad(gm: fx.GraphModule, params: frozenset[str]) -> set[fx.Node]:
    """Values that may carry a gradient: floating tensors downstream of params or inputs.

    A split's output list carries them through to its getitems; without it, a value reached
    only through a fused qkv split would lose its gradient all-reduce (Megatron f). A new
    buffer (``zeros_like(x)``) carries none: it reads only ``x``'s shape.
    """
    out = set()
    for node in gm.graph.nodes:
        if not _floating(val(node)):
            continue
        if node.op == "placeholder" or (node.op == "get_attr" and node.target in params):
            out.add(node)
        elif (node.op == "call_function" and node.target not in FRESH_BUFFERS
              and any(a in out for a in node.all_input_nodes)):
            out.add(node)
    return out


def is_distributed(p) -> bool:
    """Some part of placement ``p`` (a multi-output op's list too) is a shard or a partial sum."""
    return any(x is not None and not isinstance(x, Replicate) for x in each(p))


def whole_roots(gm: fx.GraphModule, state: Propagation) -> frozenset[str]:
    """Roots whose every block is kept whole on every rank, entered only from replicated
    values with no conversion: their values are replicated values for gradient syncs.

    A root entered through a conversion (sequence parallelism's gather) is not: the
    conversion's backward already sums the partial gradient it hands back.
    """
    roots = {name for name, spec in state.specs.roots.items() if spec.fully_replicated}
    for node in gm.graph.nodes:
        root = _root(state, node)
        if root not in roots:
            continue
        for a in node.all_input_nodes:
            if _root(state, a) != root and ((a, node) in state.conversions or is_distributed(
                    state.placements.get(a))):
                roots.discard(root)
    return frozenset(roots)


def _root(state: Propagation, node: fx.Node) -> str | None:
    """The root ``node``'s output is cut from; a multi-output op's (``unbind`` of a head's
    pairs in x-transformers' RoPE) when each of its tensors is cut from that one root."""
    cuts = [p for p in each(state.placements.get(node)) if p is not None]
    roots = {p.layout.root for p in cuts if isinstance(p, Shard)}
    return roots.pop() if len(roots) == 1 and all(isinstance(p, Shard) for p in cuts) else None


def grad_syncs(gm, state: Propagation, needs_grad: set,
               whole: frozenset[str]) -> dict[str, tuple[str, ...]]:
    """Replicated values some consumers differentiate only partially (per rank) -> those
    consumers, which read the value through one gradient all-reduce (Megatron's *f*).
    ``whole``: :func:`whole_roots` of ``state`` (their values count as replicated).

    Sum, then reduce: a replicated value every differentiating consumer of which is partial,
    computed by a replicated op from one value that carries a gradient, passes its gradient
    to that value through a Jacobian every rank shares (a VJP is linear in the gradient), so
    the sum over ranks may be taken there instead. The sync moves up, and the syncs of values
    forked from one (each expert's ``index_select`` of the tokens, each expert's pick of the
    routing weights) become one. A value made from several pieces of one value synced anyway
    moves its sync there too (:func:`_rejoined`).
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    copies = copies_of_whole_chunks(gm, state, needs_grad, whole)
    partial: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in needs_grad and _replicated(state, node, whole) and node not in copies:
            users = [u for u in node.users if _partial_grad_edge(state, node, u, whole)]
            if users:
                partial[node] = users
    for node in copies:  # their partial gradient reaches replicated inputs outside the chain
        for a in node.all_input_nodes:
            if (a in needs_grad and a not in copies and (a, node) not in state.conversions
                    and isinstance(state.placements.get(a), Replicate)):
                partial.setdefault(a, []).append(node)
    for node in reversed(gm.graph.nodes):
        for up in _hoisted_to(state, node, partial.get(node, ()), needs_grad, whole, partial):
            partial.pop(node, None)
            partial.setdefault(up, []).append(node)
    return {n.name: tuple(u.name for u in sorted(partial[n], key=order.__getitem__))
            for n in sorted(partial, key=order.__getitem__)}


def _replicated(state: Propagation, node: fx.Node, whole: frozenset[str]) -> bool:
    return isinstance(state.placements.get(node), Replicate) or _root(state, node) in whole


def _partial_grad_edge(state: Propagation, value: fx.Node, user: fx.Node,
                       whole: frozenset[str]) -> bool:
    dst = state.conversions.get((value, user))
    if dst is not None:
        return isinstance(dst, Shard) and dst.layout.root not in whole
    return is_distributed(state.placements.get(user)) and _root(state, user) not in whole


def _hoisted_to(state: Propagation, node: fx.Node, partial_users, needs_grad: set,
                whole: frozenset[str], partial: dict) -> list[fx.Node]:
    """The replicated values ``node``'s partial gradient may be summed at: its one input with a
    gradient, or several that are pieces of one value synced anyway (:func:`_rejoined`); or
    none."""
    if not partial_users:
        return []
    if any(u not in partial_users and (u in needs_grad or u.op == "output") for u in node.users):
        return []  # some consumer's gradient is whole on every rank: it must not be summed
    carriers = _carriers(state, node, needs_grad, whole)
    if not carriers or any(c.op != "call_function" for c in carriers):
        return []
    if len(carriers) == 1 or _rejoined(state, node, carriers, needs_grad, whole, partial):
        return carriers
    return []


def _carriers(state: Propagation, node: fx.Node, needs_grad: set,
              whole: frozenset[str]) -> list[fx.Node]:
    """The inputs with a gradient of a replicated op that reads only replicated values with no
    conversion (a gathered or reduced input's backward is no plain VJP on each rank)."""
    if node.op != "call_function":
        return []
    inputs = [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]
    if any(not _replicated(state, a, whole) or (a, node) in state.conversions for a in inputs):
        return []
    return [a for a in inputs if a in needs_grad]


def _rejoined(state: Propagation, node: fx.Node, carriers: list, needs_grad: set,
              whole: frozenset[str], partial: dict) -> bool:
    """Whether ``carriers`` are pieces of one value whose own gradient is synced anyway
    (HunyuanImage's single-stream block reorders its normed tokens, ``cat([h[:, :-t],
    h[:, -t:]])``, for q, k and v while its MLP reads ``h``): each computed from it through
    ops of one input with a gradient, read by nothing else on the way. Summed there, one
    sync of ``h`` replaces two of the same size."""
    sources, path = set(), {node}
    for c in carriers:
        n = c
        while n not in partial:
            path.add(n)
            up = _carriers(state, n, needs_grad, whole)
            if len(up) != 1:
                return False
            n = up[0]
        sources.add(n)
    return len(sources) == 1 and all(
        u in path or not (u in needs_grad or u.op == "output")
        for n in path - {node} for u in n.users)


def copies_of_whole_chunks(gm, state: Propagation, needs_grad: set,
                            whole: frozenset[str]) -> dict[fx.Node, bool]:
    """Replicated values computed, with no conversion, from a chunk kept whole on every rank
    (``require_whole``) or from such values -> whether every gradient they receive is partial.

    A whole chunk is part of its chain: each rank's gradient of it is a partial sum, which the
    chain's own gradient sync (at its column-parallel root's input) adds up. A value computed
    from it (Mamba-2's ``C . B``) is the same while every consumer differentiates it partially;
    one that something differentiates whole on every rank would be summed ``world_size`` times
    (the refinement ``whole_grads_into_chunks`` keeps such chains replicated).
    """
    copies: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(state.placements.get(node), Replicate):
            continue
        if any((a, node) not in state.conversions and (a in copies or whole_shard(state, a, whole))
               for a in node.all_input_nodes):
            copies[node] = False
    for node in reversed(list(copies)):
        copies[node] = all(_partial_grad_edge(state, node, u, whole) or copies.get(u, False)
                           for u in node.users if u in needs_grad or u.op == "output")
    return copies


def whole_shard(state: Propagation, node: fx.Node, whole: frozenset[str]) -> bool:
    """A whole chunk of a root that is cut elsewhere (a value of a whole root is replicated)."""
    p = state.placements.get(node)
    return isinstance(p, Shard) and state.specs.is_full(p.layout) and p.layout.root not in whole


def partial_grads(state: Propagation, value: fx.Node, user: fx.Node, dst) -> bool:
    """Whether the replicated value a conversion produces is differentiated partially per rank.

    A gather whose result a sharded op reads, and a re-shard (S -> S on another dim or layout:
    gathered whole, then sliced per rank) both hand each rank's slice of the gradient back to
    a replicated value: the gather's backward must sum those over ranks.
    """
    src = state.placements.get(value)
    if isinstance(dst, Shard):
        return isinstance(src, Shard) and (
            src.dim != dst.dim or not state.specs.contains(src.layout, dst.layout))
    return isinstance(dst, Replicate) and is_distributed(state.placements.get(user))
