"""Advanced indexing by a constant run of consecutive indices is planned as the slice it is.

Falcon's multi-query attention takes its one key head out of the fused projection with
``qkv[..., [-2], :]``: an ``aten.index.Tensor`` whose index is a constant tensor the model
built from a Python list. Read as advanced indexing, it picks rows of the sharded dim by
position, which no rank can do on its own shard, so the projection would stay whole. It is
the same value as ``qkv[..., -2:-1, :]``, a slice, and a slice of a fused projection is a
chunk the planner already shards, or keeps whole on every rank (``OpView.require_whole``).

So before planning, an index whose only index tensor is a constant 1-D integer run ``[a, a+1,
..., b-1]`` becomes ``slice(x, dim, a, b)`` followed by ``clone`` (indexing returns a new
tensor, a slice a view: the clone keeps a later in-place write on the result from reaching
``x``). Negative positions count from the end of the dim, whose size must be static: on a
dynamic one a slice would quietly clip where the index raises.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from tpcompile.passes.planner.dims import size_expr

__all__ = ["constant_index_as_slice_pass"]

aten = torch.ops.aten


def _constant(gm: fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor a constant index holds: a ``get_attr`` of a non-parameter, possibly through
    the ``lift_fresh_copy`` torch.export puts after a tensor the model builds from a list."""
    if isinstance(node, fx.Node) and node.target is aten.lift_fresh_copy.default:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = operator.attrgetter(node.target)(gm)
    return None if isinstance(value, torch.nn.Parameter) else value


def _run(index: torch.Tensor | None, size) -> tuple[int, int] | None:
    """``(a, b)`` when ``index`` is the integers ``a, a+1, ..., b-1`` of a dim of ``size``."""
    if (index is None or index.dim() != 1 or index.numel() == 0 or index.is_floating_point()
            or index.dtype is torch.bool or not isinstance(size, int) or index.is_meta):
        return None
    values = [int(v) for v in index.tolist()]
    if not all(-size <= v < size for v in values):
        return None  # out of range: left to raise as the model would
    values = [v % size for v in values]
    if values != list(range(values[0], values[0] + len(values))):
        return None
    return values[0], values[-1] + 1


def constant_index_as_slice_pass(gm: fx.GraphModule) -> PassResult:
    g = gm.graph
    changed = False
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not aten.index.Tensor:
            continue
        x, indices = node.args[0], list(node.args[1])
        picked = [(d, i) for d, i in enumerate(indices) if i is not None]
        if len(picked) != 1:
            continue
        dim, index = picked[0]
        bounds = _run(_constant(gm, index), size_expr(x.meta["val"].shape[dim]))
        if bounds is None:
            continue
        with g.inserting_before(node):
            part = g.call_function(aten.slice.Tensor, (x, dim, *bounds))
            copy = g.call_function(aten.clone.default, (part,))
        whole = (slice(None),) * dim
        part.meta = {**node.meta, "val": x.meta["val"][(*whole, slice(*bounds))]}
        copy.meta = dict(node.meta)
        node.replace_all_uses_with(copy)
        g.erase_node(node)
        if index.op == "call_function" and not index.users:  # the lift_fresh_copy
            g.erase_node(index)
        changed = True
    g.lint()
    return PassResult(gm, changed)
