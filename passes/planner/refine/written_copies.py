"""Written copies: an in-place write that would land on a copy of sharded data keeps it whole.

An in-place write (slice assignment) into sharded data lands on a copy when the data reaches
it through a conversion, or through the gradient sync (Megatron's *f*) by which a sharded
chain reads a replicated value (:mod:`tpcompile.passes.planner.mutations` finds the
conflicts). Keeping the roots behind the written data replicated makes the write land where
the unsharded model's does. A write into a KV-cache buffer that asks for its shard is no copy:
freeze stores the buffer sharded, so the write lands in each rank's own shard.
"""

from __future__ import annotations

import functools

from torch import fx

from tpcompile.core.placement import Replicate, Shard
from tpcompile.passes.planner.grad_syncs import grad_syncs, whole_roots
from tpcompile.passes.planner.mutations import write_conflicts, written_args
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.reads import roots_behind
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.rules import cache_behind

__all__ = ["written_copies"]


def written_copies(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Kill the roots whose sharded data an in-place op would write on a copy of.

    The copy is a conversion, or the gradient sync (Megatron's *f*) through which a sharded
    chain reads a replicated value: then the chain's roots are the ones that make it.
    Keeping them replicated makes the write land where the unsharded model's does.
    """
    params = constraints.params

    @functools.cache
    def syncs() -> dict:  # only models with in-place writes ask
        return grad_syncs(gm, state, constraints.needs_grad, whole_roots(gm, state))

    def copied(value, user) -> bool:
        if (value, user) in state.conversions:
            return not _cache_slice(value, user, state, params)
        return value.name in syncs()

    out = {}
    conflicts = write_conflicts(gm, copied)
    nodes = {n.name: n for n in gm.graph.nodes} if conflicts else {}
    for c in conflicts:
        value = c.edge[0]
        readers = _sharded_readers(state, [nodes[u] for u in syncs().get(value.name, ())])
        for node in [value] + c.chain + readers:
            for root in roots_behind(state, node, set()):
                out.setdefault(root, f"{c.op.name} ({c.op.target}) writes into its sharded data "
                                     "in place; sharded, the write would land on a copy")
    return Decision(killed=out)


def _sharded_readers(state: Propagation, nodes: list[fx.Node]) -> list[fx.Node]:
    """The first distributed values downstream of ``nodes`` through replicated ones: where a
    synced value's gradient becomes partial (the sync may sit above them, at a fork)."""
    out, todo, seen = [], list(nodes), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(state.placements.get(node), Replicate):
            todo.extend(node.users)
        else:
            out.append(node)
    return out


def _cache_slice(value: fx.Node, user: fx.Node, state: Propagation, params) -> bool:
    """A write into a KV-cache buffer that asks for its shard: ``freeze`` stores the
    buffer sharded, so the write lands in each rank's own shard, not on a copy."""
    return (value in written_args(user) and isinstance(state.placements.get(value), Replicate)
            and isinstance(state.conversions[(value, user)], Shard)
            and cache_behind(value, params) is not None)
