"""Weight-only quantized weights: integer tensors a matmul reads through their dequantization.

gpt-fast's int8 linear reads ``weight.to(x.dtype)``; a group-wise int4 one unpacks nibbles
with shifts and masks, stacks them, casts and applies ``(w - 8) * scale + zero`` per group of
the input dim before the matmul. Either way the matmul's weight operand is computed from
stored tensors alone (no activation reaches it), and one of them is an integer tensor: the
*quantized weight*. The planner treats it as the parameter behind that operand, so the matmul
starts a column-parallel root or joins a row-parallel one exactly as a float weight would;
the root is named by the quantized weight.

The matmul then asks for a shard of its dequantized operand. :func:`absorb_dequantized`
pulls that shard back through the dequantization onto the stored tensors (the integer weight
and its scales / zeros), so each rank stores and dequantizes only its rows (column-parallel)
or its groups of the input dim (row-parallel). Which dim of a stored tensor carries the cut is
not guessed from names: each candidate cut of each stored tensor is propagated forward through
the rule table, and the one that arrives as the wanted shard, with no conversion on the way,
is kept. A cut of the input dim that would split a group is no candidate (the view into
groups is misaligned), so groups stay whole; the weight then stays replicated and is sliced
at its use.
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from tpcompile.core.placement import Misaligned, Replicate, Shard
from tpcompile.passes.planner.dims import shape, split_layout, val
from tpcompile.passes.planner.rules import PARAM_MATMULS

__all__ = ["dequantized_weight", "absorb_dequantized", "dequantized_readers", "quantized_weights"]

# a dequantization is a short computation: the search behind a matmul operand gives up past
# this many nodes (an activation's history is the whole graph)
MAX_NODES = 32
MAX_CANDIDATES = 256  # cut combinations tried per dequantized operand


def stored_inputs(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(the get_attr tensors ``node`` is computed from, the nodes computing it from them, in
    graph order), or None when an input reaches it or the computation is longer than
    ``MAX_NODES``."""
    leaves, inner, todo, seen = [], [], [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > MAX_NODES or n.op == "placeholder":
            return None
        if n.op == "get_attr":
            leaves.append(n)
            continue
        inner.append(n)
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(leaves, key=order.get), sorted(inner, key=order.get)


def _integer(node: fx.Node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())


def dequantized_weight(node: fx.Node) -> fx.Node | None:
    """The quantized weight a floating ``node`` dequantizes: the largest integer get_attr it
    is computed from when only stored tensors reach it; else None."""
    v = val(node)
    if (node.op == "get_attr" or not isinstance(v, torch.Tensor)
            or not v.is_floating_point()):
        return None
    found = stored_inputs(node)
    if found is None:
        return None
    ints = [leaf for leaf in found[0] if _integer(leaf)]
    return max(ints, key=lambda n: val(n).numel()) if ints else None


def dequantized_readers(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Stored tensor a matmul operand is dequantized from (a quantized weight, its scales and
    zeros) -> that matmul: the op whose placement says if the tensor's cut is column- or
    row-parallel."""
    out: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.target not in PARAM_MATMULS:
            continue
        for arg in node.all_input_nodes:
            if dequantized_weight(arg) is not None:
                out.update((leaf, node) for leaf in stored_inputs(arg)[0])
    return out


def quantized_weights(gm: fx.GraphModule) -> frozenset[str]:
    """Targets of the tensors weight-only quantization stores for a matmul's weight (integer
    weights, the scales and zeros their dequantization reads before the matmul)."""
    return frozenset(leaf.target for leaf in dequantized_readers(gm))


def absorb_dequantized(gm: fx.GraphModule, state, constraints) -> None:
    """Store the tensors a dequantized matmul operand is computed from sharded, so that the
    dequantization computes the shard its matmul asks for (no slicing at use)."""
    from tpcompile.passes.planner.propagate import _same

    for (value, user), wanted in list(state.conversions.items()):
        if (not isinstance(wanted, Shard) or not isinstance(state.placements.get(value), Replicate)
                or dequantized_weight(value) is None):
            continue
        leaves, inner = stored_inputs(value)
        readers = [u for u in value.users if val(u) is not None]
        if not all(_same(state.specs, state.conversions.get((value, u)), wanted) for u in readers):
            continue
        if not _private(leaves + inner, set(leaves + inner) | set(readers)):
            continue
        placements = _pulled_back(leaves, inner, value, wanted, state, constraints)
        if placements is None:
            continue
        state.placements.update(placements)
        for u in readers:
            state.conversions.pop((value, u), None)


def _private(nodes: list[fx.Node], allowed: set) -> bool:
    """Every data user of ``nodes`` is among ``allowed``: nothing else reads the tensors or
    their partial dequantization (a shared tensor keeps its own plan)."""
    return all(u in allowed for n in nodes for u in n.users if val(u) is not None)


def _pulled_back(leaves, inner, value, wanted: Shard, state, constraints) -> dict | None:
    """Placements of the dequantization (stored tensors first) that produce ``wanted`` at
    ``value``: the candidate with the most stored elements cut that propagates to it with no
    conversion inside; None if none does."""
    from tpcompile.passes.planner.propagate import _same

    options = [_candidates(leaf, wanted, state.specs) for leaf in leaves]
    combos = sorted(itertools.islice(itertools.product(*options), MAX_CANDIDATES),
                    key=lambda c: -sum(val(leaf).numel() for leaf, p in zip(leaves, c)
                                       if isinstance(p, Shard)))
    for combo in combos:
        if not any(isinstance(p, Shard) for p in combo):
            return None
        placements = _forward(dict(zip(leaves, combo)), inner, state, constraints)
        if placements is not None and _same(state.specs, placements.get(value), wanted):
            return placements
    return None


def _candidates(leaf: fx.Node, wanted: Shard, specs) -> list:
    """Replicated, or a cut of one dim holding the root indices ``wanted`` holds: the dim
    itself when its size is the wanted dim's, else that dim viewed as (size, rest)."""
    out = [Replicate()]
    for d, size in enumerate(shape(leaf)):
        if not isinstance(size, int) or size < 2 or wanted.layout.size % size:
            continue
        try:
            layout = (wanted.layout if size == wanted.layout.size
                      else split_layout(wanted.layout, size, wanted.layout.size // size))
            specs.ranges(layout)
        except Misaligned:
            continue  # the cut would split a unit of the root (a group of the input dim)
        out.append(Shard(d, layout))
    return out


def _forward(start: dict, inner: list[fx.Node], state, constraints) -> dict | None:
    """Propagate ``start`` (stored tensor -> placement) through ``inner`` with the rule table;
    None when a rule converts an operand or asks for a new cut on the way."""
    from tpcompile.passes.planner.propagate import Propagation, _visit

    trial = Propagation(placements={**state.placements, **start}, specs=state.specs)
    for node in inner:
        trial.placements[node] = _visit(node, trial, state.specs, constraints)
        if trial.conversions or trial.demands or trial.no_rule or trial.fallbacks:
            return None
    return {n: trial.placements[n] for n in list(start) + inner}

