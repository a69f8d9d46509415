"""Ops that move data between dims without being views: complex <-> real pairs, padding,
advanced indexing, stacking."""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.core.placement import Shard
from tpcompile.passes.planner.dims import norm_dim, shape, size_expr, val
from tpcompile.passes.planner.rules.table import register
from tpcompile.passes.planner.rules.einsum import einsum_rule

aten = torch.ops.aten


@register(aten.view_as_complex.default, aten.view_as_real.default)
def _complex_view(op):
    """``(..., 2)`` real <-> ``(...)`` complex: the leading dims keep their positions (they are
    not broadcast-aligned from the right); a shard of the real/imaginary pair is gathered."""
    x = op.node.args[0]
    lead = min(len(shape(x)), len(shape(op.node)))
    return einsum_rule(op, [(x, list(range(lead)) + [None] * (len(shape(x)) - lead))],
                       list(range(lead)) + ["pair"] * (len(shape(op.node)) - lead), "unary")


@register(aten.constant_pad_nd.default)
def _constant_pad(op):
    """``F.pad``: a padded dim is not cut (its shards would need the pad in the middle); any
    other dim's shard passes. Padding with zeros is linear, so a partial input stays partial."""
    x, pad = op.node.args[0], list(op.node.args[1])
    value = op.node.args[2] if len(op.node.args) > 2 else 0
    n = len(shape(x))
    padded = {n - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    labels = [None if d in padded else d for d in range(n)]
    out = [f"padded{d}" if d in padded else d for d in range(n)]
    return einsum_rule(op, [(x, labels)], out, linear="unary" if value == 0 else None)


def _index_dims(node: fx.Node) -> tuple[list[int], list]:
    """``x[i0, i1, ...]``: the dims of ``x`` some index reads, and per output dim the dim of
    ``x`` it keeps (None for the dims the indices make)."""
    x, indices = node.args[0], list(node.args[1])
    n = len(shape(x))
    picked = [d for d, i in enumerate(indices) if i is not None]
    adjacent = picked == list(range(picked[0], picked[-1] + 1)) if picked else True
    width = len(shape(node)) - (n - len(picked))
    kept = [d for d in range(n) if d not in picked]
    at = picked[0] if picked and adjacent else 0  # where the index dims land in the output
    return picked, kept[:at] + [None] * width + kept[at:]


def _index_carries(node: fx.Node, p: Shard):
    """A shard of a dim no index reads moves to its output dim (an MoE's per-expert biases
    picked per token, ``bias[expert_ids]``, cut by features): see ``_absorb_params``."""
    picked, out = _index_dims(node)
    return None if p.dim in picked else Shard(out.index(p.dim), p.layout)


@register(aten.index.Tensor, carries=_index_carries, keeps_zeros=True)
def _index(op):
    """``x[i0, i1, ...]`` with index tensors (advanced indexing): gathering rows is linear, so a
    partial ``x`` stays partial, and a shard of a dim no index reads moves to its output dim."""
    x, indices = op.node.args[0], list(op.node.args[1])
    picked, out_labels = _index_dims(op.node)
    operands = [(x, [None if d in picked else d for d in range(len(shape(x)))])]
    operands += [(i, [None] * len(shape(i))) for i in indices if i is not None]
    return einsum_rule(op, operands, [lab if lab is not None else f"i{j}"
                                      for j, lab in enumerate(out_labels)], linear="mul")


@register(aten.index_select.default, keeps_zeros=True)
def _index_select(op):
    """``x.index_select(dim, index)``: rows of one dim picked by a 1-D index (XLNet's relative
    shift). Like ``x[..., index]``: linear in ``x``, a shard of any other dim passes."""
    x, dim, index = op.node.args[:3]
    n = len(shape(x))
    dim = norm_dim(dim, n)
    return einsum_rule(op, [(x, [d if d != dim else None for d in range(n)]), (index, [None])],
                       [d if d != dim else "picked" for d in range(n)], linear="mul")


@register(aten.gather.default)
def _gather(op):
    """``x.gather(dim, index)``: ``out[..., i, ...] = x[..., index[..., i, ...], ...]`` along
    ``dim``; every other dim pairs ``x``'s with ``index``'s (which may be shorter), so a shard
    of one passes when both are cut alike: a replicated index is sliced like ``x``. Shorter
    dims of the index are not aligned with ``x``'s cut, so ``x`` is then gathered."""
    x, dim, index = op.node.args[:3]
    n = len(shape(x))
    dim = norm_dim(dim, n)
    aligned = [d for d in range(n)
               if d != dim and size_expr(shape(index)[d]) == size_expr(shape(x)[d])]
    labels = [d if d in aligned else None for d in range(n)]
    return einsum_rule(op, [(x, labels), (index, labels)],
                       [d if d in aligned else f"g{d}" for d in range(n)], linear="mul")


@register(aten.stack.default)
def _stack(op):
    """``stack`` is ``cat`` of unsqueezed tensors: the new dim carries no shard."""
    tensors = [t for t in op.node.args[0] if isinstance(val(t), torch.Tensor)]
    n = len(shape(op.node))
    dim = norm_dim(op.node.args[1] if len(op.node.args) > 1 else 0, n)
    labels = [d for d in range(n) if d != dim]
    return einsum_rule(op, [(t, labels) for t in tensors],
                       [d if d != dim else "stacked" for d in range(n)], linear="add")
