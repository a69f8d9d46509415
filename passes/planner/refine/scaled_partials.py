"""Scaled partial sums: a row-parallel output scaled by a value with a gradient is reduced first.

An adaLN-Zero block scales each branch's output by a gate computed from the conditioning,
``x + gate * o_proj(h)``. A product is linear in each operand, so the rule table carries the
partial sum through it and reduces after: the same forward bytes, but the gate's gradient is
then the product's partial gradient times each rank's share, a partial sum of its own that
rides in the block's backward sync (the gate's bytes, every block). Megatron reduces at the
projection, where the gate's gradient comes out whole. Here a partial sum read by a product
with a replicated value that carries a gradient (``Constraints.needs_grad``) is reduced where
it is made, when it reaches the product directly or through ops that pass a sum on (AuraFlow
drops the branch out before its gate, ERNIE-Image permutes and casts it), and nothing is saved
by waiting:

- its sum meets no other partial sum before it is reduced (a MoE's experts, each scaled by
  its routing weight and summed: one all-reduce for all of them beats one per expert);
- and it never gets smaller on the way (a stacked experts' dense output, scaled and summed
  over the experts, is cheaper reduced after the sum).

A value with no gradient (a constant, a mask, a frozen model's gate) leaves the plan as it was.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from tpcompile.core.placement import Partial, Replicate
from tpcompile.passes.planner.dims import example_size, shape
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.refine.decision import Decision

__all__ = ["scaled_partials"]

_PRODUCTS = {torch.ops.aten.mul.Tensor}


def scaled_partials(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Reduce early the partial sums scaled by a value with a gradient (module docstring)."""
    early = {node.name for node, p in state.placements.items()
             if isinstance(p, Partial) and p.reduce == "sum"
             and node.name not in constraints.reduce_early
             and any(_scaled(state, src, u, constraints.needs_grad)
                     for src, u in _readers(state, node))
             and _alone(state, node)}
    return Decision(reduce_early=early)


def _readers(state: Propagation, node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(value, reader) pairs of ``node``'s partial sum: its readers, and through the ops that
    pass it on still a partial sum (a dropout, a cast, a permute), theirs."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            out.append((n, u))
            if isinstance(state.placements.get(u), Partial) and u.target not in _PRODUCTS:
                todo.append(u)
    return out


def _scaled(state: Propagation, node: fx.Node, user: fx.Node, needs_grad: frozenset) -> bool:
    """``user`` multiplies ``node``'s partial sum by a replicated value with a gradient."""
    if user.target not in _PRODUCTS:
        return False
    return any(a is not node and a in needs_grad and isinstance(state.placements.get(a), Replicate)
               for a in user.all_input_nodes)


def _alone(state: Propagation, node: fx.Node) -> bool:
    """``node``'s partial sum meets no other one and never shrinks before it is reduced."""
    reach, todo = {node}, [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in reach and isinstance(state.placements.get(u), Partial):
                reach.add(u)
                todo.append(u)
    if any(isinstance(state.placements.get(a), Partial) and a not in reach
           for n in reach for a in n.all_input_nodes):
        return False
    sizes = [_numel(n) for n in [node, *reach]]
    return None not in sizes and min(sizes) >= sizes[0]


def _numel(node: fx.Node) -> int | None:
    """``node``'s elements at the example's sizes (hints: no guard added); None for a size
    the data decides (no hint)."""
    dims = shape(node)
    if any(not isinstance(d, int) and d.node.hint is None for d in dims):
        return None
    return math.prod(example_size(d) for d in dims)
