"""Elementwise ops: pointwise math, casts, dropout, division, and their in-place variants.

Also the rule :func:`tpcompile.passes.planner.rules.rule_for_target` gives any other op torch
tags pointwise (``TAGGED[torch.Tag.pointwise]``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.runtime.rng import sharded_dropout
from tpcompile.passes.planner.dims import shape, val
from tpcompile.passes.planner.rules.table import RULES, TAGGED, Rule, register, zero_filled
from tpcompile.passes.planner.rules.einsum import broadcast_labels, tensor_args, einsum_rule
from tpcompile.passes.planner.rules.writes import in_place

aten = torch.ops.aten


def pointwise_rule(linear):
    """The rule of an elementwise op; ``linear`` as in :func:`einsum_rule`."""
    def propagate(op):
        out = shape(op.node)
        tensors = kept = tensor_args(op.node)
        if linear == "add" and op.sum_is_carried():
            carried = _carried_sum(op, tensors)
            if carried is not None:
                return carried
        if linear == "add" and any(isinstance(op.placement(t), Partial) for t in tensors):
            kept = [t for t in tensors if not zero_filled(t)] or tensors
        # a sum of partial sums is one, and so is a partial sum plus zeros (left out above);
        # partial + a number would add the number on every rank
        kind = linear
        if linear == "add":
            kind = "add" if len(kept) > 1 else ("unary" if len(kept) < len(tensors) else None)
        return einsum_rule(op, broadcast_labels(kept, out), list(range(len(out))), kind)
    return propagate


def _carried_sum(op, tensors):
    """A sum the planner carries partial (``Constraints.carried``, see
    :mod:`tpcompile.passes.planner.refine.carried_sums`): each replicated operand enters as rank 0's
    share (a ``summand`` conversion: zeros on the other ranks), partial ones as they are, so
    the output is one partial sum. A partial sum the planner reduces early for its other
    readers is read here as the partial sum it is, which needs no conversion at all. None
    (planned as any sum) when an operand is sharded."""
    placements = [op.placement(t) for t in tensors]
    if any(not isinstance(p, (Partial, Replicate)) for p in placements):
        return None
    for t in tensors:
        op.require(t, Partial())
    return Partial()


UNARY_LINEAR = [
    aten.clone.default, aten.contiguous.default, aten.detach.default,
    aten.mul.Scalar, aten.div.Scalar, aten.lift_fresh_copy.default,
]
POINTWISE = [
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default,
    aten.sigmoid.default, aten.exp.default, aten.log.default, aten.rsqrt.default,
    aten.sqrt.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.where.self, aten.add.Scalar, aten.sub.Scalar,
    aten.bitwise_not.default, aten.abs.default, aten.erf.default, aten.reciprocal.default,
    aten.softplus.default, aten.leaky_relu.default, aten.elu.default, aten.hardtanh.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.gt.Scalar,
    aten.logical_not.default, aten.clamp.default,
]
register(*UNARY_LINEAR, elementwise=True, scales=True)(pointwise_rule("unary"))
# rule_for_target: any other op torch tags pointwise (and not random)
TAGGED[torch.Tag.pointwise] = Rule(pointwise_rule(None), elementwise=True)


@register(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default,
          elementwise=True, scales=True)
def _cast(op):
    """A cast is linear into a floating (or complex) dtype; into integers or bool it rounds,
    so a partial sum is reduced first. Only ``args[0]`` is data (``type_as``'s other operand
    gives a dtype)."""
    x, out = op.node.args[0], val(op.node)
    linear = "unary" if out.dtype.is_floating_point or out.dtype.is_complex else None
    labels = list(range(len(shape(op.node))))
    return einsum_rule(op, [(x, labels)], labels, linear)


def _localize_dropout(node, local):
    """A sharded dropout draws the whole tensor's mask and keeps its slice (see tpcompile.runtime.rng)."""
    (p,) = local.out_placements(node)
    x, prob, train = node.args
    if isinstance(p, Shard) and prob and train:
        local.replace_target(node, sharded_dropout, (
            x, prob, train, p.dim, p.layout.size, list(local.specs.ranges(p.layout)[local.rank])))


register(aten.dropout.default, localize=_localize_dropout, scales=True)(pointwise_rule("unary"))
register(*POINTWISE, elementwise=True)(pointwise_rule(None))
# bit twiddling of integer tensors (unpacking quantized weights); torch tags some of them
# pointwise, not the ``&`` / ``|`` ones
register(aten.__and__.Scalar, aten.bitwise_and.Scalar, aten.__or__.Scalar, aten.bitwise_or.Scalar,
         aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor_Scalar, aten.__lshift__.Scalar,
         aten.bitwise_left_shift.Tensor_Scalar, elementwise=True)(pointwise_rule(None))
# sums: a replicated operand may enter as rank 0's share of a partial sum (carried_sums)
register(aten.add.Tensor, aten.sub.Tensor, operator.add, operator.sub, elementwise=True,
         sums=True)(pointwise_rule("add"))
register(aten.mul.Tensor, operator.mul, elementwise=True)(pointwise_rule("mul"))


@register(aten.div.Tensor, operator.truediv)
def _divide(op):
    """Linear in the dividend only: a partial divisor is reduced first."""
    divisor = op.node.args[1]
    partial = isinstance(divisor, fx.Node) and isinstance(op.placement(divisor), Partial)
    return pointwise_rule(None if partial else "mul")(op)


IN_PLACE = {  # in-place overload -> the out-of-place overload whose rule it follows
    aten.relu_.default: aten.relu.default, aten.gelu_.default: aten.gelu.default,
    aten.silu_.default: aten.silu.default, aten.tanh_.default: aten.tanh.default,
    aten.sigmoid_.default: aten.sigmoid.default, aten.hardtanh_.default: aten.hardtanh.default,
    aten.leaky_relu_.default: aten.leaky_relu.default, aten.elu_.default: aten.elu.default,
    aten.clamp_.default: aten.clamp.default, aten.exp_.default: aten.exp.default,
    aten.masked_fill_.Scalar: aten.masked_fill.Scalar,
    aten.add_.Tensor: aten.add.Tensor, aten.add_.Scalar: aten.add.Scalar,
    aten.sub_.Tensor: aten.sub.Tensor, aten.sub_.Scalar: aten.sub.Scalar,
    aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
    aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar,
}
for _op, _like in IN_PLACE.items():
    RULES[_op] = Rule(in_place(RULES[_like].propagate))
