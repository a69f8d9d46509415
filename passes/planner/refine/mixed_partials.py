"""Early reductions: a partial sum that one consumer all-reduces is read reduced by all.

Once the all-reduce is paid for one consumer, every consumer should read its result;
carrying the partial sum further (through the norm's ``x * rsqrt(...)`` into q/k/v, say)
would only need more all-reduces later (the rules read ``Constraints.reduce_early``).
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.placement import Partial, Replicate
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.reads import consumed
from tpcompile.passes.planner.refine.decision import Decision

__all__ = ["mixed_partials"]


def mixed_partials(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Partial sums some consumer reduces while others carry them on partially."""
    out = set()
    for node, p in state.placements.items():
        if not isinstance(p, Partial):
            continue
        reads = [consumed(state, node, u) for u in node.users]
        if any(isinstance(r, Replicate) for r in reads) and any(isinstance(r, Partial) for r in reads):
            out.add(node.name)
    return Decision(reduce_early=out - constraints.reduce_early)
