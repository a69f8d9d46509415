"""Reductions and norms: sums and means (linear: a shard of a reduced dim gives a partial sum),
max / var / topk / sort, and ops that read whole dims (softmax, layer / RMS norm, cumsum)."""

from __future__ import annotations

import math

import torch

from tpcompile.core.placement import Partial
from tpcompile.runtime.partial import mean_term
from tpcompile.passes.planner.dims import norm_dim, shape
from tpcompile.passes.planner.rules import register
from tpcompile.passes.planner.rules.einsum import _tensor_args, einsum_rule

aten = torch.ops.aten


def _reduced_dims(node) -> tuple[list[int], bool]:
    """The dims a reduction ``op(x, dims, keepdim)`` folds (all of them when none are named)."""
    n = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if dims in (None, []):
        return list(range(n)), keepdim
    return sorted({norm_dim(d, n) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}), keepdim


def _reduce(linear, statistic=False):
    """A reduction over some dims. ``linear``: a shard of a reduced dim gives a partial sum.

    ``statistic``: that partial sum is a per-token statistic (a norm's mean of squares), whose
    all-reduce the planner accepts only in a region that is otherwise Megatron's
    (``_dead_regions``): a norm over the residual stream must still end a region."""
    def propagate(op):
        x = op.node.args[0]
        n = len(shape(x))
        reduced, keepdim = _reduced_dims(op.node)
        out = [d if (d not in reduced or keepdim) else None for d in range(n)]
        labels = [f"r{d}" if d in reduced else d for d in range(n)]
        result = einsum_rule(op, [(x, labels)], [o for o in out if o is not None] if not keepdim
                             else [d if d not in reduced else f"kept{d}" for d in range(n)], linear)
        if statistic and isinstance(result, Partial):
            op.mark_statistic()
        return result
    return propagate


def _localize_mean(node, local):
    """A mean over a sharded dim: this rank's sum over the whole dims' size (its Partial term)."""
    dims, keepdim = _reduced_dims(node)
    if not any(local.input_sharded_on(node, d) for d in dims):
        return
    whole = math.prod(int(shape(node.args[0])[d]) for d in dims)
    local.replace_target(node, mean_term, (node.args[0], dims, keepdim, whole, node.kwargs.get("dtype")))
    node.kwargs = {}


register(aten.sum.dim_IntList, aten.sum.default)(_reduce("mul"))
register(aten.mean.dim, aten.mean.default, localize=_localize_mean)(_reduce("mul", statistic=True))
register(aten.amax.default, aten.amin.default, aten.var.correction, aten.std.correction,
         aten.argmax.default)(_reduce(None))

# op -> (index of its dim argument, whether the output keeps that dim): ops that return values
# and indices along one dim
_ALONG_DIM = {aten.max.dim: (1, False), aten.min.dim: (1, False), aten.topk.default: (2, True),
              aten.sort.default: (1, True)}


@register(*_ALONG_DIM)
def _values_and_indices(op):
    """``max(x, dim)``, ``topk``, ``sort``: values and their indices along one dim (attention
    sinks' ``max`` over keys, routers' ``topk`` over experts). A shard of another dim passes to
    both outputs; the dim itself is needed whole on every rank."""
    x = op.node.args[0]
    n = len(shape(x))
    index, kept = _ALONG_DIM[op.node.target]
    dim = op.node.args[index] if len(op.node.args) > index else op.node.kwargs.get("dim", -1)
    dim = norm_dim(dim, n)
    if not kept:
        kept = op.node.args[2] if len(op.node.args) > 2 else op.node.kwargs.get("keepdim", False)
    out = [d if d != dim else f"o{d}" for d in range(n) if d != dim or kept]
    p = einsum_rule(op, [(x, [d if d != dim else f"r{d}" for d in range(n)])], out)
    return [p, p]


def _last_dims_free(count_fn, linear=None):
    """Ops that read whole dims (softmax or cumsum over dim, layer_norm over normalized_shape);
    ``linear`` as in :func:`einsum_rule` (a cumulative sum is linear)."""
    def propagate(op):
        x = op.node.args[0]
        n = len(shape(x))
        free = count_fn(op.node, n)
        labels = [f"r{d}" if d in free else d for d in range(n)]
        operands = [(x, labels)]
        for a in _tensor_args(op.node)[1:]:  # weight / bias over the normalized dims
            operands.append((a, [f"r{d}" for d in range(n - len(shape(a)), n)]))
        # the whole of each free dim feeds every output element: its label is not carried over
        return einsum_rule(op, operands, [d if d not in free else f"o{d}" for d in range(n)], linear)
    return propagate


register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
         aten._log_softmax.default)(_last_dims_free(lambda node, n: {norm_dim(node.args[1], n)}))
register(aten.layer_norm.default, aten.rms_norm.default)(
    _last_dims_free(lambda node, n: set(range(n - len(node.args[1]), n))))
register(aten.cumsum.default)(_last_dims_free(lambda node, n: {norm_dim(node.args[1], n)}, "unary"))
register(aten.logcumsumexp.default)(
    _last_dims_free(lambda node, n: {norm_dim(node.args[1], n)}))
