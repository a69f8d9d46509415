"""Split biases off matmuls before planning, so a row-parallel bias is added once.

A row-parallel matmul produces partial sums; its bias must be added once, after the
all-reduce, not on every rank. Planning on ``linear(x, W) + b`` instead of ``linear(x, W, b)``
makes that fall out of the rule table (``Partial + Replicate`` needs the all-reduce first), and
lets a column-parallel bias be sharded like any other operand. After the rewrite,
:func:`tpcompile.passes.rewrite.fuse_bias.fuse_bias_pass` folds every bias that still directly
follows its matmul back in, so eager mode runs one ``addmm`` as before.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

aten = torch.ops.aten

__all__ = ["split_bias_pass"]


def split_bias_pass(gm: fx.GraphModule) -> PassResult:
    """``linear(x, W, b)`` -> ``linear(x, W) + b``; ``addmm(b, x, W)`` -> ``mm(x, W) + b``."""
    g = gm.graph
    changed = False
    for node in list(g.nodes):
        if node.target is aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, w, b = node.args
            matmul_args, target = (x, w), aten.linear.default
        elif node.target is aten.addmm.default and not node.kwargs:
            b, x, w = node.args[:3]
            matmul_args, target = (x, w), aten.mm.default
        else:
            continue
        users = list(node.users)
        node.target, node.args = target, matmul_args
        with g.inserting_after(node):
            add = g.create_node("call_function", aten.add.Tensor, (node, b), name=f"{node.name}_bias")
        add.meta = dict(node.meta)
        for u in users:
            u.replace_input_with(node, add)
        changed = True
    return PassResult(gm, changed)
