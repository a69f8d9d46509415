"""Reductions: sums and means (linear: a shard of a reduced dim gives a partial sum), vector
norms, max / var / topk / sort, ops that read whole dims (softmax, cumsum, flip; layer and RMS
norms in :mod:`.norms`) and histograms."""

from __future__ import annotations

import math

import torch

from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.runtime.partial import mean_term
from tpcompile.passes.planner.dims import norm_dim, shape
from tpcompile.passes.planner.rules.table import register
from tpcompile.passes.planner.rules.einsum import tensor_args, einsum_rule

aten = torch.ops.aten


def reduced_dims(node, at: int = 1) -> tuple[list[int], bool]:
    """The dims a reduction ``op(x, dims, keepdim)`` folds (all of them when none are named);
    ``at``: the position of ``dims`` (``linalg_vector_norm(x, ord, dims, keepdim)``: 2)."""
    n = len(shape(node.args[0]))
    dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim")
    keepdim = node.args[at + 1] if len(node.args) > at + 1 else node.kwargs.get("keepdim", False)
    if dims in (None, []):
        return list(range(n)), keepdim
    return sorted({norm_dim(d, n) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}), keepdim


def reduction_rule(linear, statistic=False, at=1):
    """A reduction over some dims. ``linear``: a shard of a reduced dim gives a partial sum.

    ``statistic``: that partial sum is a per-token statistic (a norm's mean of squares), whose
    all-reduce the planner accepts only in a chain that is otherwise Megatron's (the
    refinement ``dead_chains``): a norm over the residual stream must still end a chain.
    ``at``: as in :func:`reduced_dims`."""
    def propagate(op):
        x = op.node.args[0]
        n = len(shape(x))
        reduced, keepdim = reduced_dims(op.node, at)
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
    dims, keepdim = reduced_dims(node)
    if not any(local.input_sharded_on(node, d) for d in dims):
        return
    whole = math.prod(int(shape(node.args[0])[d]) for d in dims)
    local.replace_target(node, mean_term, (node.args[0], dims, keepdim, whole, node.kwargs.get("dtype")))
    node.kwargs = {}


register(aten.sum.dim_IntList, aten.sum.default)(reduction_rule("mul"))
register(aten.mean.dim, aten.mean.default, localize=_localize_mean)(reduction_rule("mul", statistic=True))
register(aten.var.correction, aten.std.correction,
         aten.argmax.default)(reduction_rule(None))


def _vector_norm(op):
    """``linalg_vector_norm`` (``F.normalize``, ``torch.linalg.vector_norm``): not linear, so a partial input
    is reduced first, and a shard of a dim it keeps passes (q / k unit-normalised per head,
    the heads cut). Over a sharded dim a finite ``ord`` > 0 is planned again through
    :func:`_norm_as_mean` (a per-token statistic, like an RMSNorm's); ``inf``, ``-inf`` and
    ``0`` (a max, a min, a count of nonzeros) gather the dim."""
    x = op.node.args[0]
    p = op.placement(x)
    order = op.node.args[1] if len(op.node.args) > 1 else op.node.kwargs.get("ord", 2)
    reduced, _ = reduced_dims(op.node, at=2)
    if (isinstance(p, Shard) and p.dim in reduced and not op.specs.is_full(p.layout)
            and math.isfinite(order) and order > 0):
        op.decompose(f"{op.node.name} is a vector norm over the sharded dim {p.dim}")
    return reduction_rule(None, at=2)(op)


def _norm_as_mean(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """``linalg_vector_norm`` of a finite ``ord`` > 0 as ``(mean(|x|^ord) * count)^(1/ord)``:
    over a sharded dim the mean is each rank's term of a per-token statistic, all-reduced
    before the root (``mean``'s rule), where the norm itself would gather the dim. A zero
    vector's norm has gradient 0, as torch's own (the root of 0 alone would give NaN)."""
    if dtype is not None:
        x = x.to(dtype)
    dims = range(x.dim()) if dim in (None, []) else dim if isinstance(dim, (list, tuple)) else [dim]
    dims = sorted({d % x.dim() for d in dims})
    powers = x * x if ord == 2 and x.is_floating_point() else x.abs().pow(ord)
    total = torch.mean(powers, dims, keepdim=keepdim) * math.prod(x.shape[d] for d in dims)
    nonzero = total > 0
    safe = torch.where(nonzero, total, torch.ones_like(total))
    root = safe.sqrt() if ord == 2 else safe.pow(1.0 / ord)
    return torch.where(nonzero, root, torch.zeros_like(root))


register(aten.linalg_vector_norm.default, decomposition=_norm_as_mean)(_vector_norm)

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


def last_dims_free(count_fn, linear=None):
    """Ops that read whole dims (softmax or cumsum over dim, a norm over normalized_shape);
    ``linear`` as in :func:`einsum_rule` (a cumulative sum is linear)."""
    def propagate(op):
        x = op.node.args[0]
        n = len(shape(x))
        free = count_fn(op.node, n)
        labels = [f"r{d}" if d in free else d for d in range(n)]
        operands = [(x, labels)]
        for a in tensor_args(op.node)[1:]:  # weight / bias over the normalized dims
            operands.append((a, [f"r{d}" for d in range(n - len(shape(a)), n)]))
        # the whole of each free dim feeds every output element: its label is not carried over
        return einsum_rule(op, operands, [d if d not in free else f"o{d}" for d in range(n)], linear)
    return propagate


register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
         aten._log_softmax.default)(last_dims_free(lambda node, n: {norm_dim(node.args[1], n)}))
register(aten.cumsum.default)(last_dims_free(lambda node, n: {norm_dim(node.args[1], n)}, "unary"))
register(aten.logcumsumexp.default)(
    last_dims_free(lambda node, n: {norm_dim(node.args[1], n)}))
# flip(x, dims): each flipped dim is read whole (its last element lands first); a permutation,
# so a partial sum stays one (SANA-WM runs its causal conv and attention backwards in time on
# flipped frames, heads cut)
register(aten.flip.default)(
    last_dims_free(lambda node, n: {norm_dim(d, n) for d in node.args[1]}, "unary"))


@register(aten.histc.default)
def _histogram(op):
    """``histc(x, bins, min, max)``: counts of ``x``'s values per bin (torchtitan's routers
    count the tokens each expert gets with it). Every count reads every value, and ``min ==
    max`` bins over the data's own range, which a shard does not know: the input is read
    whole (a sharded one gathered) and the counts are replicated."""
    op.require(op.node.args[0], Replicate())
    return Replicate()
