"""Cache cuts: a KV cache whose readers all slice one shard of it stores only that shard.

With fewer kv heads than ranks each rank reads only its query heads' kv heads: the replicated
in-place write into the cache buffer is cut like its readers' slices, so the rule stores only
that shard (``_cut_cache`` in the rule table reads ``Constraints.cache_cuts``).
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.placement import Replicate, Shard
from tpcompile.passes.planner.freeze import pulled_back
from tpcompile.passes.planner.mutations import written_args
from tpcompile.passes.planner.propagate import Constraints, Propagation, same_placement, view_chain
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.rules import cache_behind

__all__ = ["cache_cuts"]


def cache_cuts(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Replicated cache writes whose readers all slice the same shard of the cache: write
    node -> that shard."""
    out = {}
    for node, p in state.placements.items():
        written = written_args(node)
        if (not isinstance(p, Replicate) or not written
                or cache_behind(written[0], constraints.params) is None):
            continue
        chain = view_chain(node)
        wanted = [state.conversions.get((chain[-1], u)) for u in chain[-1].users]
        if wanted and all(isinstance(w, Shard) and same_placement(state.specs, wanted[0], w) for w in wanted):
            placements = pulled_back(chain, wanted[0], state.specs)
            if placements is not None:
                out[node.name] = placements[0]
    return Decision(cache_cuts={k: v for k, v in out.items() if k not in constraints.cache_cuts})
