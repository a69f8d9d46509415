"""Side chains that join another chain's shards: keep their first matmul whole.

A low-rank side chain beside a column-parallel matmul (LoRA's ``base(x) + B(A(x)) * s``)
starts a column root of its own at ``A``, so ``B`` contracts the cut rank dim and returns a
partial sum. That sum then meets the base's output, which is sharded by the base's columns:
the add has to reduce it (an all-reduce, or a reduce-scatter into the base's cut) on every
step, where Megatron's plan pays nothing. Kept whole, ``A`` computes its few columns on
every rank, ``B`` reads a replicated activation and starts a column root of its own on its
output features, and the add joins two shards cut alike: no forward collective at all.

The rule is about placements, not names: a root whose partial sum some op reduces only to
add it to shards of a different root is killed (kept replicated) by the planner, which then
re-propagates. A partial sum reduced into replicated code (the residual
stream) or into sequence shards is an ordinary row-parallel exit and is left alone.
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.placement import Partial, Shard
from tpcompile.passes.planner.propagate import SEQUENCE, Constraints, Propagation
from tpcompile.passes.planner.reads import roots_behind
from tpcompile.passes.planner.refine.decision import Decision

__all__ = ["partials_joining_shards"]


def partials_joining_shards(gm: fx.GraphModule, state: Propagation,
                            constraints: Constraints) -> Decision:
    """Kill the roots whose partial sum is reduced only to join another root's shards.

    For each conversion of a ``Partial`` value: the op reading it produces a ``Shard`` of a
    weight root (not the sequence), and another of its operands arrives as that same shard.
    The roots behind the partial sum (those that are not the joined root) are the side
    chain's; keeping them whole turns the chain's row-parallel matmul into a column one cut
    like the shards it joins.
    """
    out = {}
    for (value, user), _ in state.conversions.items():
        joined = _joined_root(state, value, user)
        if joined is None:
            continue
        for root in sorted(roots_behind(state, value, set()) - {joined}):
            out.setdefault(root, f"its partial sum {value.name} would be reduced only to join "
                                 f"{joined}'s shards in {user.name}: kept whole, the next "
                                 f"matmul is cut like {joined} and no collective is paid")
    return Decision(killed=out)


def _joined_root(state: Propagation, value: fx.Node, user: fx.Node) -> str | None:
    """The weight root ``user`` outputs shards of, when it reads the partial sum ``value``
    beside another operand already sharded on that root; else None."""
    if not isinstance(state.placements.get(value), Partial):
        return None
    out = state.placements.get(user)
    if not isinstance(out, Shard) or out.layout.root == SEQUENCE:
        return None
    for arg in user.all_input_nodes:
        if arg is value:
            continue
        p = state.conversions.get((arg, user), state.placements.get(arg))
        if isinstance(p, Shard) and p.layout.root == out.layout.root:
            return out.layout.root
    return None
