"""Demands: how a root must be cut, as the ops reading it ask (whole heads, chunks, groups).

A view that splits features into ``(heads, head_dim)``, a split of a fused qkv output, or
grouped-query heads meeting their query groups each say how a root must be cut (whole heads,
per-chunk blocks, whole groups); propagation records them (``Propagation.demands``) and the
planner adds the new ones to its constraints, so the next round cuts the root accordingly.
They come first: they change how propagation cuts roots, and a root killed before its cut
is known stays killed.
"""

from __future__ import annotations

from torch import fx

from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.refine.decision import Decision

__all__ = ["demands"]


def demands(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """The demands this round met that the constraints do not hold yet."""
    return Decision(demands=[d for d in state.demands if d not in constraints.demands])
