"""Stale ties: a tied table whose matmul no longer shards it stays whole in its lookup too.

A tie (:mod:`tpcompile.passes.planner.refine.tied_tables`) is made while the LM head's chain
stands; when that chain is refused for another reason, a vocabulary-parallel lookup alone
would follow a cut no matmul makes, so its root is killed with the rest.
"""

from __future__ import annotations

from torch import fx

from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.rules import is_lookup

__all__ = ["stale_ties"]


def stale_ties(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Kill the tied tables that only lookups still shard."""
    return Decision(killed={
        root: "its tied table's matmul keeps it whole" for root in constraints.tied
        if root in state.roots and all(is_lookup(u) for u in state.root_users.get(root, ()))})
