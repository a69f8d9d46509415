"""Fuse a sequence-parallel gather into the column-parallel linears it feeds.

After :mod:`insert_collectives`, a Megatron-SP chain starts with
``x = gather_into_chain(shard)`` feeding ``linear(x, w_q)``, ``linear(x, w_k)``, ... Autograd
would keep the gathered ``x`` (world size times the shard) alive until backward for the weight
gradients. :func:`tpcompile.runtime.collectives.gathered_linears` computes the same linears but saves
only the shard and gathers it again in backward, as Megatron-LM does, so the activation memory
of sequence parallelism really is divided by the world size.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from tpcompile.runtime import collectives as C

aten = torch.ops.aten

__all__ = ["fuse_sequence_linears_pass"]


def _is_linear_of(node: fx.Node, x: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is aten.linear.default
            and node.args[0] is x and x not in node.args[1:])


def _hoist(node: fx.Node, before: fx.Node, order: dict[fx.Node, int]) -> None:
    """Move ``node`` and the operands it needs that run after ``before`` to just before it
    (attribute reads and grad-sync wrappers of the weights: nothing that reads activations)."""
    if order[node] < order[before]:
        return
    for a in node.all_input_nodes:
        _hoist(a, before, order)
    before.prepend(node)
    order[node] = order[before] - 0.5


def fuse_sequence_linears_pass(gm: fx.GraphModule) -> fx.GraphModule:
    g = gm.graph
    for gather in list(g.nodes):
        if gather.target is not C.gather_into_chain:
            continue
        users = list(gather.users)
        if not users or not all(_is_linear_of(u, gather) for u in users):
            continue
        params = []
        for u in users:
            params += [u.args[1], u.args[2] if len(u.args) > 2 else None]
        order = {n: i for i, n in enumerate(g.nodes)}
        for p in params:  # weights reach the linears through small nodes (grad syncs): hoist
            if isinstance(p, fx.Node):
                _hoist(p, users[0], order)
        with g.inserting_before(users[0]):
            fused = g.call_function(C.gathered_linears, tuple(gather.args) + tuple(params))
        for i, u in enumerate(users):
            with g.inserting_before(u):
                out = g.call_function(operator.getitem, (fused, i))
            out.meta = dict(u.meta)
            u.replace_all_uses_with(out)
            g.erase_node(u)
        g.erase_node(gather)
    return gm
