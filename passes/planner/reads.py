"""What a propagation says about one value: the placement a user reads, the roots behind it.

The refinements (:mod:`tpcompile.passes.planner.refine`) and freeze ask these of a
:class:`~tpcompile.passes.planner.propagate.Propagation`; they live here, beside the engine,
so that no refinement reaches into another for them.
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.placement import Partial, Shard
from tpcompile.passes.planner.propagate import Propagation

__all__ = ["consumed", "roots_behind"]


def consumed(state: Propagation, value: fx.Node, user: fx.Node):
    """The placement ``user`` reads ``value`` in (after any conversion)."""
    return state.conversions.get((value, user), state.placements.get(value))


def roots_behind(state: Propagation, node: fx.Node, seen: set) -> set[str]:
    """The roots a value's distributed placement comes from (a partial sum: its inputs')."""
    if node in seen:
        return set()
    seen.add(node)
    p = state.placements.get(node)
    if isinstance(p, Shard):
        return set(state.specs.bases(p.layout.root))
    if isinstance(p, (Partial, list, tuple)):
        return set().union(*(roots_behind(state, a, seen) for a in node.all_input_nodes))
    return set()
