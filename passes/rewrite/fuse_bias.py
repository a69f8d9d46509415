"""Fuse biases back into their matmuls after the rewrite, so eager mode runs one ``addmm``.

:func:`tpcompile.passes.prepare.split_bias.split_bias_pass` planned every biased matmul as
``linear(x, W) + b`` (a row-parallel bias is added once, after the all-reduce). Where the bias
still directly follows its matmul on this rank (no collective between them), it is folded back
into ``linear`` / ``addmm``.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.passes.planner.propagate import bias_added

aten = torch.ops.aten

__all__ = ["fuse_bias_pass"]


def fuse_bias_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """``linear(x, W) + b`` -> ``linear(x, W, b)`` where the sum directly follows the matmul."""
    g = gm.graph
    for node in list(g.nodes):
        if not bias_added(node):
            continue
        mm, b = node.args
        if not (isinstance(mm, fx.Node) and len(mm.users) == 1):
            continue
        if mm.target is aten.linear.default and len(mm.args) == 2:
            mm.args = (mm.args[0], mm.args[1], b)
        elif mm.target is aten.mm.default:
            mm.target, mm.args = aten.addmm.default, (b, mm.args[0], mm.args[1])
        else:
            continue
        node.replace_all_uses_with(mm)
        g.erase_node(node)
    return gm
