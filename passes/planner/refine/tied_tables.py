"""Tied tables: an embedding reading a weight a column-parallel LM head shards follows its cut.

A weight sharded by a column-parallel LM head that an embedding also reads makes that
embedding vocabulary-parallel too, so the table is sharded once (the lookup's rule reads
``Constraints.tied``).
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.placement import Shard
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.reads import consumed
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.rules import is_lookup

__all__ = ["tied_tables"]


def tied_tables(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Roots whose weight an embedding still reads whole: that embedding should shard it too."""
    out = set()
    for root in state.roots:
        w = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == root), None)
        for user in (w.users if w is not None else ()):
            if is_lookup(user) and not isinstance(
                    consumed(state, w, user), Shard):
                out.add(root)
    return Decision(tied=out - constraints.tied)
