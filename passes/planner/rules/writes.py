"""Ops that write into a tensor: in-place ops, writes into KV caches, writes into fresh buffers.

In place, the written tensor must keep its placement (:func:`in_place`); a cache written in
place may be stored sharded (:func:`cache_behind`); a write into a buffer made in the graph is
made out of place (``FRESH_BUFFERS``, ``SCATTERS``, :func:`value_of_write`) and its
functional form has a rule here.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.passes.planner.dims import norm_dim, shape, val
from tpcompile.passes.planner.rules.table import RULES, Rule, is_view, register
from tpcompile.passes.planner.rules.einsum import (
    broadcast_labels, replicate_all, tensor_args, einsum_rule,
)

aten = torch.ops.aten


def in_place(propagate, into_cache=False):
    """``relu_``, ``add_``...: the out-of-place rule, as long as the written tensor keeps its
    placement. Converting a replicated one would hand the write a copy, so the other operands
    are gathered instead; a sharded or partial one converted anyway is judged by
    :func:`tpcompile.passes.planner.mutations.check_mutations`.

    ``into_cache``: a write into a buffer (a KV cache) may ask for the buffer sharded: the
    planner then stores the buffer itself sharded (``_absorb_params``), so the write lands in
    each rank's own shard and no copy is made."""
    def rule(op):
        written = op.node.args[0]
        if into_cache and cache_behind(written, op.constraints.params) is not None:
            cut = op.constraints.cache_cuts.get(op.node.name)
            return _cut_cache(op, propagate(op), cut) if cut is not None else propagate(op)
        out = propagate(op)
        if written in op.required and isinstance(op.placement(written), Replicate):
            op.required.clear()
            for a in tensor_args(op.node):
                op.require(a, Replicate())
            return Replicate()
        return out
    return rule


# --------------------------------------------------------------------------- cache writes

def cache_behind(arg, params) -> fx.Node | None:
    """The buffer (not a parameter) ``arg`` is, or is a view of through single-use views: a
    static KV cache written in place, which may be stored sharded like an activation."""
    node = arg
    while isinstance(node, fx.Node) and node.op == "call_function" and is_view(node):
        if len(node.users) != 1:
            return None
        node = node.args[0]
    if (isinstance(node, fx.Node) and node.op == "get_attr" and len(node.users) == 1
            and node.target not in params):
        return node
    return None


def _cut_cache(op, out, cut: Shard):
    """A replicated write into a cache its readers only slice: store the slice (the kv heads
    this rank's query heads read), writing this rank's slice of the values into it."""
    if not isinstance(out, Replicate):
        return out
    op.required.clear()
    labels = _cache_labels(op)
    label = labels[0][1][cut.dim]
    for arg, arg_labels in labels:
        if label in arg_labels:
            op.require(arg, Shard(arg_labels.index(label), cut.layout))
    return cut


def _cache_labels(op):
    """[(cache, labels), (values, labels)] of an index_put_ / index_copy_ (see below)."""
    return (_index_put_labels if op.node.target in (aten.index_put_.default, aten.index_put.default)
            else _index_copy_labels)(op)


def _index_put(op):
    """``cache[:, :, pos] = v``: ``v`` is laid out as the cache with the indexed dims replaced
    by the positions' shape; a dim the write keeps (heads) carries its shard into the cache.
    Overwriting or accumulating, the write is linear in the pair (rows kept plus rows
    written), so partial ``x`` and ``v`` stay partial, and a partial ``v`` written into zeros
    is one: litgpt's ``y[idx] += expert(x[idx])`` sums its row-parallel experts into one
    partial sum, all-reduced once."""
    labels = _index_put_labels(op)
    if labels is None or _cut_at_positions(op, labels[0]):
        return replicate_all(op)  # masks, scattered index tensors, positions cut over ranks
    for i in op.node.args[1]:
        if isinstance(i, fx.Node):
            op.require(i, Replicate())
    if _written_partially(op, labels[0][0], labels[1][0]):
        return Partial()  # a looped MoE's expert outputs put back in token order into zeros
    return einsum_rule(op, labels, labels[0][1], linear="add")


def _index_put_labels(op):
    x, indices, values = op.node.args[:3]
    n = len(shape(x))
    at = [d for d, i in enumerate(indices) if i is not None]
    if (not at or at != list(range(at[0], at[-1] + 1))
            or any(val(indices[d]).dtype == torch.bool for d in at)):
        return None  # index tensors apart move their dims first; a mask indexes several dims
    width = max(len(shape(i)) for i in indices if i is not None)
    kept = [d for d in range(n) if d not in at]
    target = list(range(at[0])) + [None] * width + kept[at[0]:]
    return [(x, [d if d not in at else f"pos{d}" for d in range(n)]),
            (values, target[len(target) - len(shape(values)):])]


def _index_copy(op):
    """``cache.index_copy_(dim, pos, v)``: ``v`` has the cache's dims, ``dim`` cut to the positions."""
    labels = _index_copy_labels(op)
    if _cut_at_positions(op, labels[0]):
        return replicate_all(op)
    op.require(op.node.args[2], Replicate())
    return einsum_rule(op, labels, labels[0][1])


def _cut_at_positions(op, written) -> bool:
    """The written tensor is sharded on a dim the positions index: global positions would
    miss each rank's rows."""
    x, labels = written
    p = op.placement(x)
    return isinstance(p, Shard) and isinstance(labels[p.dim], str)


def _index_copy_labels(op):
    x, dim, _, source = op.node.args[:4]
    n = len(shape(x))
    dim = norm_dim(dim, n)
    return [(x, [d if d != dim else "pos" for d in range(n)]),
            (source, [d if d != dim else None for d in range(n)])]


register(aten.index_put.default)(_index_put)
register(aten.index_copy.default)(_index_copy)
RULES[aten.index_put_.default] = Rule(in_place(_index_put, into_cache=True))
RULES[aten.index_copy_.default] = Rule(in_place(_index_copy, into_cache=True))


# --------------------------------------------------------------------------- fresh buffers

# ops that make a new graph-local tensor: writes into one can be made out of place
# (tpcompile.passes.prepare.functionalize_fresh_writes)
FRESH_BUFFERS = frozenset({
    aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default,
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
    aten.full.default, aten.full_like.default, aten.new_full.default,
    aten.ones.default, aten.ones_like.default, aten.new_ones.default,
})
# a view of a fresh buffer an in-place write goes through -> the op that writes a value back
# through that view (only these are written out of place: functionalize_fresh_writes_pass)
SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default,
            aten.select.int: aten.select_scatter.default}


def value_of_write(g: fx.Graph, node: fx.Node, functional) -> fx.Node:
    """New nodes in ``g`` computing what the in-place ``node`` leaves in the tensor it writes;
    ``functional`` is its out-of-place overload. ``copy_``'s (``aten.copy``) has no
    derivative, so a copy is its source cast and broadcast to the view instead."""
    if node.target is not aten.copy_.default:
        return g.call_function(functional, node.args, node.kwargs)
    view, src = node.args[:2]
    dtype = view.meta["val"].dtype
    if src.meta["val"].dtype != dtype:
        src = g.call_function(aten._to_copy.default, (src,), {"dtype": dtype})
        src.meta.update(node.meta)
        src.meta["val"] = node.args[1].meta["val"].to(dtype)
    return g.call_function(aten.expand_as.default, (src, view))


# fresh buffers whose values are any placement's as they are on every rank: zeros are a
# partial sum of zeros, and an empty buffer's values are unspecified
_ANY_PLACEMENT = frozenset({
    aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default,
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
})
# fills, by the position of their fill value: filled with 0 they are zeros (export writes
# ``new_zeros`` as ``full(size, 0)``)
_FILLS = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}


def any_placement(node) -> bool:
    """``node`` is a fresh buffer of zeros (or unspecified values): as it is on every rank, it
    is also a partial sum, or any shard, of itself."""
    if not isinstance(node, fx.Node):
        return False
    at = _FILLS.get(node.target)
    return node.target in _ANY_PLACEMENT or (at is not None and len(node.args) > at
                                             and node.args[at] == 0)


def _written_partially(op, base, src) -> bool:
    """A partial ``src`` written into a replicated zero-filled or empty ``base``: the result is
    a partial sum as it is, with no all-reduce of ``src`` first."""
    return (isinstance(op.placement(src), Partial) and isinstance(op.placement(base), Replicate)
            and any_placement(base))


@register(aten.index_add.default)
def _index_add(op):
    """``x.index_add(dim, index, source)``: ``x`` plus ``source``'s rows added at ``index``.
    A sum, so partial ``x`` and ``source`` stay partial (Mixtral's expert loop accumulating
    row-parallel outputs into ``zeros_like``), and a shard of another dim passes."""
    x, _, index, source = op.node.args[:4]
    labels = _index_copy_labels(op)
    if _cut_at_positions(op, labels[0]):
        return replicate_all(op)
    op.require(index, Replicate())
    if _written_partially(op, x, source):
        return Partial()
    return einsum_rule(op, labels, labels[0][1], linear="add")


@register(aten.slice_scatter.default, aten.select_scatter.default)
def _scatter_into_view(op):
    """``x`` with ``x[..., a:b]`` (``slice_scatter``) or ``x[..., i]`` (``select_scatter``)
    replaced by ``src``: linear in the pair, and a shard of a dim the view keeps passes."""
    x, src, dim = op.node.args[:3]
    n = len(shape(x))
    dim = norm_dim(dim, n)
    written = [(x, [d if d != dim else "pos" for d in range(n)])]
    if op.node.target == aten.slice_scatter.default:
        written.append((src, [d if d != dim else None for d in range(n)]))
    else:
        written.append((src, [d for d in range(n) if d != dim]))
    if _cut_at_positions(op, written[0]):
        return replicate_all(op)
    if _written_partially(op, x, src):
        return Partial()
    return einsum_rule(op, written, written[0][1], linear="add")


@register(aten.expand_as.default)
def _expand_as(op):
    """``src.expand_as(x)`` (a ``copy_`` made out of place): ``x`` gives only its shape, so a
    shard of either passes (the other is sliced locally) and a partial ``src`` stays partial.
    Cut on different dims, ``x``'s cut is kept: it is where the write lands."""
    src, x = op.node.args[:2]
    if isinstance(op.placement(src), Partial) and not isinstance(op.placement(x), Shard):
        return Partial()
    out = shape(op.node)
    labels = list(range(len(out)))
    px, psrc = op.placement(x), op.placement(src)
    (_, src_labels), = operands = broadcast_labels([src], out)
    if (isinstance(px, Shard) and isinstance(psrc, Shard) and not op.specs.is_full(psrc.layout)
            and src_labels[psrc.dim] != px.dim):
        result = einsum_rule(op, [(x, labels)], labels)
        op.require(src, Shard(src_labels.index(px.dim), result.layout)
                   if px.dim in src_labels and isinstance(result, Shard) else Replicate())
        return result
    return einsum_rule(op, [(x, labels)] + operands, labels)
