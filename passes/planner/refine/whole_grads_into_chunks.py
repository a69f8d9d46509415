"""Whole chunks whose copies are differentiated whole on every rank: keep their chain whole.

A chunk kept whole on every rank (``require_whole``: Mamba-2's single B / C group inside
``in_proj``) is part of its chain, and each rank's gradient of it is a partial sum the
chain's own gradient sync adds up. A replicated value computed from it that replicated code
differentiates whole on every rank would hand that whole gradient back on each rank, and the
sync would count it once per rank (:func:`~tpcompile.passes.planner.grad_syncs.copies_of_whole_chunks`
says which copies are partial). Such chains are kept replicated.
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.capture import origin
from tpcompile.passes.planner.grad_syncs import copies_of_whole_chunks, whole_roots, whole_shard
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.refine.decision import Decision

__all__ = ["whole_grads_into_chunks"]


def whole_grads_into_chunks(gm: fx.GraphModule, state: Propagation,
                            constraints: Constraints) -> Decision:
    """Kill the roots of whole chunks a replicated value computed from them hands a gradient
    that is whole on every rank (read by replicated code that differentiates it)."""
    out = {}
    needs_grad, whole = constraints.needs_grad, whole_roots(gm, state)
    copies = copies_of_whole_chunks(gm, state, needs_grad, whole)
    for node, partial in copies.items():
        if partial or node not in needs_grad:
            continue
        todo, seen = [node], set()
        while todo:
            n = todo.pop()
            for a in n.all_input_nodes:
                if a in copies and a not in seen:
                    seen.add(a)
                    todo.append(a)
                elif whole_shard(state, a, whole):
                    out.setdefault(state.placements[a].layout.root, (
                        f"{node.name} ({origin(node)}) is computed from a chunk kept whole and "
                        "differentiated whole on every rank: the chain's gradient sync would "
                        "count its gradient once per rank"))
    return Decision(killed=out)
