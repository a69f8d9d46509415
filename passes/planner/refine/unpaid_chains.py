"""Unpaid chains: a per-sample column -> row chain that costs more than it saves stays whole.

A chain (roots that meet in one op, as :mod:`.dead_chains` forms them) whose column matmuls
all read one row per sample (their activation has no more rows than the model's batch, while
the model's largest matmul activation has more: the token rows) is priced by
:func:`~tpcompile.passes.planner.chain_cost.chain_cost`: its matmuls (column and row) and the
weights it cuts against its all-reduces, forward (the partial sums behind its roots, reduced)
and backward (each column input that carries a gradient). A chain that does not pay is killed
with the numbers that decided it, which ``explain`` lists with the weight's source line. Chains
on token rows are never judged: they pay at any deployment's size, so no language model's plan
changes. The batch is dim 0 of the model's first input. An LM head ``vocab_parallel`` asks to
cut is not judged (generate's head reads the last position: one row per sample).
"""

from __future__ import annotations

import networkx as nx
from torch import fx

from tpcompile.core.placement import Partial, Shard
from tpcompile.passes.planner.chain_cost import (ChainCost, chain_cost, operands, per_sample_chain,
                                                 pricing, stored)
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.reads import consumed, roots_behind
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.rules import is_param_matmul
from tpcompile.passes.planner.rules.vocabulary import vocabulary_heads

__all__ = ["unpaid_chains"]


def unpaid_chains(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Kill the roots of per-sample chains whose collectives cost more than they save."""
    users = {u for found in state.root_users.values() for u in found}
    priced = pricing(constraints.options.chain_cost, state.specs.world_size, gm,
                     [operands(u)[0] for u in users])
    if priced is None:
        return Decision()
    device, batch = priced
    chains = nx.Graph()
    chains.add_nodes_from(state.roots)
    chains.add_edges_from((a, b) for a, b in state.links if a in state.roots and b in state.roots)
    asked = (vocabulary_heads(gm, state.specs.roots) if constraints.options.vocab_parallel
             else set())
    dead = {}
    for component in nx.connected_components(chains):
        cols = {u for r in component for u in state.root_users.get(r, ())}
        if component & asked or not per_sample_chain([operands(u)[0] for u in cols], batch):
            continue
        cost = _price(state, constraints.needs_grad, component, cols, batch, device)
        if not cost.pays:
            names = ", ".join(sorted(u.name for u in cols))
            why = f"kept whole by cost: sharding it ({names}) does not pay: {cost}"
            dead.update((root, why) for root in component)
    return Decision(killed=dead)


def _price(state: Propagation, needs_grad: frozenset, component: set, cols: set, batch: int,
           device) -> ChainCost:
    """The cost of one chain: its matmuls, its cut weights, its all-reduces."""
    rows = {n for n, p in state.placements.items() if p is not None
            and not isinstance(p, (Shard, list, tuple)) and is_param_matmul(n)
            and any(_sharded_from(state, a, n, component) for a in n.all_input_nodes)}
    weights = {w for n in cols | rows for a in n.all_input_nodes
               if _sharded_from(state, a, n, component) and (w := stored(a)) is not None}
    reduced = {v for (v, _), dst in state.conversions.items()
               if isinstance(state.placements.get(v), Partial) and not isinstance(dst, Partial)
               and roots_behind(state, v, set()) & component}
    synced = {a for u in cols if (a := operands(u)[0]) is not None and a in needs_grad}
    return chain_cost(cols | rows, weights, reduced | synced, batch, state.specs.world_size, device)


def _sharded_from(state: Propagation, value: fx.Node, user: fx.Node, component: set) -> bool:
    p = consumed(state, value, user)
    return isinstance(p, Shard) and not component.isdisjoint(state.specs.bases(p.layout.root))

