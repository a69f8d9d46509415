"""Maxima and minima over a cut dim: a partial extremum, reduced by one all-reduce of max / min.

Dynamic activation quantization (torchao's ``Int8DynamicActivation*`` configs) scales each
token's activations by the largest magnitude of its whole row: ``amin`` and ``amax`` over the
features, ``maximum(-min(amin, 0), max(amax, 0))``, divided into a scale. Before a
row-parallel matmul the row is cut, so each rank sees its features only. The max of the row
is the max of the ranks' maxima, exactly (no rounding: a max picks one of its inputs), so
``amax`` of a cut dim is ``Partial("max")``: each rank holds a candidate, and the op that first
needs the value reads it all-reduced by max (one number per token), where gathering the row
would move the whole activation.

The ops here pass such a partial on where the extremum commutes with them, so the min and the
max of the row meet in one all-reduce: ``maximum`` / ``minimum`` of partials of their own kind
and replicated operands, and ``neg``, which turns a max into a min. Every other rule reads a
partial extremum reduced first (``OpView.placement``).

A max has a gradient only at its argmax, and torch splits it among ties along the whole dim,
which no rank sees; so a value some gradient may flow through (``Constraints.needs_grad``:
downstream of a trainable weight or a floating input; none in an inference-only capture) keeps
the plan of any reduction: its cut dim is gathered.
"""

from __future__ import annotations

import torch

from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.passes.planner.rules.einsum import tensor_args
from tpcompile.passes.planner.rules.pointwise import pointwise_rule
from tpcompile.passes.planner.rules.reductions import reduced_dims, reduction_rule
from tpcompile.passes.planner.rules.table import RULES, Rule, register
from tpcompile.passes.planner.rules.writes import in_place

aten = torch.ops.aten

# the reduction -> the partial it leaves over a cut dim
_REDUCE = {aten.amax.default: "max", aten.amin.default: "min"}
# the elementwise op -> the partial it passes on (with replicated operands of any kind)
_KEEPS = {aten.maximum.default: "max", aten.minimum.default: "min"}
_FLIP = {"max": "min", "min": "max"}


@register(*_REDUCE)
def _reduce_extremum(op):
    """``amax`` / ``amin`` over dims one of which is cut: each rank's extremum of its
    features, a partial the first reader all-reduces by max / min (a per-token statistic, as
    a norm's mean of squares). Otherwise, or where a gradient flows, as any reduction: a cut
    dim it reduces is gathered."""
    x = op.node.args[0]
    p = op.placement(x)
    reduced, _ = reduced_dims(op.node)
    if (isinstance(p, Shard) and p.dim in reduced and not op.specs.is_full(p.layout)
            and x not in op.constraints.needs_grad):
        op.mark_statistic()
        return Partial(_REDUCE[op.node.target])
    return reduction_rule(None)(op)


@register(*_KEEPS, elementwise=True, extremal=True)
def _keep_extremum(op):
    """``maximum`` of max partials and replicated operands is the max partial of the ranks'
    maxima (``max(max_r a_r, b) = max_r max(a_r, b)``); ``minimum`` likewise with min."""
    kind = _KEEPS[op.node.target]
    placements = [op.placement(t) for t in tensor_args(op.node)]
    if Partial(kind) in placements and all(p in (Partial(kind), Replicate()) for p in placements):
        return Partial(kind)
    return _reduced_first(op, pointwise_rule(None))


@register(aten.neg.default, elementwise=True, extremal=True)
def _negate(op):
    """``-max_r a_r = min_r -a_r``: a max partial negated is a min partial, and back; any
    other placement as a linear op's."""
    kind = _extremum(op.placement(op.node.args[0]))
    return Partial(_FLIP[kind]) if kind else pointwise_rule("unary")(op)


RULES[aten.neg_.default] = Rule(in_place(pointwise_rule("unary")))


@register(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
          aten.empty_like.default, elementwise=True, extremal=True)
def _fresh_like(op):
    """A new tensor of a partial extremum's shape reads no value of it: replicated, with no
    all-reduce (``zeros_like(amax)`` beside the max it is compared with)."""
    return Replicate() if _extremum(op.placement(op.node.args[0])) else pointwise_rule(None)(op)


def _extremum(p) -> str | None:
    """``"max"`` / ``"min"`` for a partial extremum, None for any other placement."""
    return p.reduce if isinstance(p, Partial) and p.reduce in _FLIP else None


def _reduced_first(op, rule):
    """``rule`` reading every partial extremum reduced (as a rule that is not ``extremal``)."""
    op.reads_extrema = False
    return rule(op)
