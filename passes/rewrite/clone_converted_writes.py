"""In-place writes into a value the rewrite inserted get a private copy to write into.

The planner accepted every remaining in-place write whose target the plan converts (see
:mod:`tpcompile.passes.planner.mutations`): nothing reads the original afterwards. After
``insert_collectives`` such a write reaches a gather's or an all-reduce's output, a view
created inside tpcompile's autograd Functions, which autograd does not allow to be modified in
place. So the write goes through a plain ``clone`` of that value instead.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.core.plan import ShardingPlan
from tpcompile.passes.planner.mutations import aliased_input, written_args

__all__ = ["clone_converted_writes_pass"]

aten = torch.ops.aten


def clone_converted_writes_pass(gm: fx.GraphModule, plan: ShardingPlan) -> fx.GraphModule:
    """An in-place op reaching a value this pipeline inserted writes into a clone of it."""
    known = plan.placements
    for node in list(gm.graph.nodes):
        for written in written_args(node):
            user, cur = node, written
            while cur.name in known and (src := aliased_input(cur)) is not None:
                user, cur = cur, src
            if cur.name in known:
                continue
            with gm.graph.inserting_before(user):
                copy = gm.graph.call_function(aten.clone.default, (cur,))
            user.replace_input_with(cur, copy)
    return gm
