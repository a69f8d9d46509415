"""Reductions in pieces: a partial sum split into pieces reduced one by one is reduced once.

Ops linear in a partial sum (splits, slices, matmuls, casts) carry it on until several
consumers each reduce their own piece (all-reduce or reduce-scatter). Mamba's ``x_proj``
output is split into dt, B and C; C is sliced once per time step, and dt runs through
``dt_proj`` before it meets the channel shards: one all-reduce where the sum is made serves
every piece (and lets ``dt_proj`` be column-parallel), instead of one collective per piece.
It runs once the chains stand (it merges reductions only of chains kept as written).
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.reads import consumed
from tpcompile.passes.planner.refine.decision import Decision

__all__ = ["partials_reduced_in_pieces"]


def partials_reduced_in_pieces(gm: fx.GraphModule, state: Propagation,
                               constraints: Constraints) -> Decision:
    """Reduce early the partial sums reduced in pieces further down.

    A partial sum read by a carried sum (``constraints.carried``) is a summand of that sum's
    tree, reduced with it once, not a piece of its own: a block's carried residual, reduced
    for the next block's norm and also added into the next block's sum, is reduced once
    where it is made.
    """
    carried = constraints.carried
    below: dict[fx.Node, frozenset | None] = {}

    def reductions(node: fx.Node) -> frozenset | None:
        """The reductions of ``node``'s partial sum downstream, as (value, placement read)
        pairs: a sum carried along several paths that meet again (litgpt's accumulator,
        gathered from and written into by each expert) is reduced once where they meet.
        None if a piece leaves otherwise."""
        if node not in below:
            found: set | None = set()
            for user in node.users:
                read = consumed(state, node, user)
                if isinstance(read, (Replicate, Shard)):
                    found.add((node, read))  # consumers reading one placement share one
                    continue
                if _partial(read) and not _partial(state.placements.get(user)):
                    continue  # not read as data: a metadata check, type_as's dtype operand
                if _partial(read) and user.name in carried:
                    continue  # a summand of a carried tree, reduced with it
                more = reductions(user) if _partial(read) else None
                if more is None:
                    found = None
                    break
                found |= more
            below[node] = None if found is None else frozenset(found)
        return below[node]

    def reduced_in_pieces(node: fx.Node) -> bool:
        return _partial(state.placements.get(node)) and len(reductions(node) or ()) >= 2

    pieces = {n.name for n, p in state.placements.items()
              if isinstance(p, Partial) and reduced_in_pieces(n)
              and not any(reduced_in_pieces(a) for a in n.all_input_nodes)}
    return Decision(reduce_early=pieces - constraints.reduce_early)


def _partial(p) -> bool:
    """A partial sum, or a multi-output op's list of them (a split of one)."""
    if isinstance(p, (list, tuple)):
        return bool(p) and all(_partial(x) for x in p)
    return isinstance(p, Partial)
