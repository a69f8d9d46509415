"""Cutting quantized weights: the stored tensors a dequantized matmul operand is computed from.

One of :func:`~tpcompile.passes.planner.freeze.freeze`'s ``ABSORB`` steps (named after its
function, like the refinements): it runs on the settled propagation before freeze reads the
plan from it. A matmul reading a dequantized weight (the graph facts of
:mod:`tpcompile.passes.planner.rules.quantized`) asks for a shard of that operand.
:func:`absorb_dequantized` pulls the shard back through the dequantization onto the stored tensors (the integer weight, its scales and zeros), so each
rank stores and dequantizes only its rows (column-parallel) or its groups of the input dim
(row-parallel). Which dim of a stored tensor carries the cut is not guessed from names: each
candidate cut of each stored tensor is propagated forward through the rule table, and the one
that arrives as the wanted shard, with no conversion on the way, is kept. A cut of the input
dim that would split a group is no candidate (the view into groups is misaligned): the
weight then stays replicated and is sliced at its use. An op of the dequantization with no
rule (torchao's ``dequantize_affine``, one custom op) is reported as any op with no rule that
meets a shard: the pipeline writes in its decomposition (a view into groups, a subtract and a
multiply) and plans again.
"""

from __future__ import annotations

import itertools
from collections import ChainMap

from torch import fx

from tpcompile.core.placement import Misaligned, Replicate, Shard
from tpcompile.passes.planner.dims import shape, split_layout, val
from tpcompile.passes.planner.propagate import Propagation, same_placement, visit
from tpcompile.passes.planner.rules.quantized import dequantized_weight, stored_inputs

__all__ = ["absorb_dequantized"]

MAX_CANDIDATES = 256  # cut combinations tried per dequantized operand


def absorb_dequantized(gm: fx.GraphModule, state, constraints) -> None:
    """Store the tensors a dequantized matmul operand is computed from sharded, so that the
    dequantization computes the shard its matmul asks for (no slicing at use)."""
    for (value, user), wanted in list(state.conversions.items()):
        if (not isinstance(wanted, Shard) or not isinstance(state.placements.get(value), Replicate)
                or dequantized_weight(value) is None):
            continue
        leaves, inner = stored_inputs(value)
        readers = [u for u in value.users if val(u) is not None]
        if not all(same_placement(state.specs, state.conversions.get((value, u)), wanted) for u in readers):
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
    options = [_candidates(leaf, wanted, state.specs) for leaf in leaves]
    combos = sorted(itertools.islice(itertools.product(*options), MAX_CANDIDATES),
                    key=lambda c: -sum(val(leaf).numel() for leaf, p in zip(leaves, c)
                                       if isinstance(p, Shard)))
    for combo in combos:
        if not any(isinstance(p, Shard) for p in combo):
            return None
        placements = _forward(dict(zip(leaves, combo)), inner, state, constraints)
        if placements is not None and same_placement(state.specs, placements.get(value), wanted):
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
    None when a rule converts an operand or asks for a new cut on the way. An op with no rule
    on the way is added to ``state.no_rule``, for the pipeline to decompose."""
    trial = Propagation(placements=ChainMap(dict(start), state.placements), specs=state.specs)
    for node in inner:
        trial.placements[node] = visit(node, trial, state.specs, constraints)
        state.no_rule.update(trial.no_rule)
        if trial.conversions or trial.demands or trial.no_rule or trial.fallbacks:
            return None
    return {n: trial.placements[n] for n in list(start) + inner}

