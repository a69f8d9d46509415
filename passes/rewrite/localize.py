"""Localize: turn each op into its per-rank form, on one rank's copy of the graph.

Export bakes sizes into the graph (``view(s0, s1, 8, 16)``, ``split(64)``,
``expand(s0, 2, 4, s1, 16)``). Once a dim is sharded, each rank must use its own local size
there. Ops over a sharded vocabulary become their vocabulary-parallel versions (a masked
lookup, a loss that never gathers the logits). What to rewrite is the rule table's business
(each rule's ``localize``); this pass supplies the rank's sizes and ranges and does the edits.
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.placement import Shard, each
from tpcompile.core.plan import ShardingPlan
from tpcompile.passes.planner.dims import norm_dim, shape
from tpcompile.passes.planner.rules import rule_for

__all__ = ["localize_pass"]


class LocalView:
    """What a rule's ``localize`` sees: the plan's placements as sizes on one rank."""

    def __init__(self, plan: ShardingPlan, rank: int, group: str):
        self.plan, self.rank, self.group, self.specs = plan, rank, group, plan.specs
        self._converted = plan.converted

    def consumed(self, value: fx.Node, user: fx.Node):
        """The placement ``user`` reads ``value`` in (after the plan's conversion, if any)."""
        return self._converted.get((value.name, user.name), self.plan.placement(value.name))

    def out_placements(self, node: fx.Node) -> list:
        return each(self.plan.placement(node.name))

    def local_size(self, placement: Shard) -> int:
        return self.specs.local_size(placement.layout, self.rank)

    def input_sharded_on(self, node: fx.Node, dim: int) -> bool:
        x = node.args[0]
        p = self.consumed(x, node)
        return isinstance(p, Shard) and p.dim == norm_dim(dim, len(shape(x)))

    def set_arg(self, node: fx.Node, index: int, value) -> None:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)

    def replace_target(self, node: fx.Node, target, args) -> None:
        node.target, node.args = target, tuple(args)


def localize_pass(gm: fx.GraphModule, plan: ShardingPlan, rank: int, group: str) -> fx.GraphModule:
    local = LocalView(plan, rank, group)
    for node in gm.graph.nodes:
        rule = rule_for(node)
        if rule is not None and rule.localize is not None and node.name in plan.placements:
            rule.localize(node, local)
    return gm
