"""Matmuls: ``linear``, ``matmul`` / ``mm`` / ``bmm``, ``einsum``, grouped (expert) matmuls and
convolutions, each labelled for :func:`einsum_rule`. Their parameter operands may start a
column-parallel root (their rules' ``matmul``)."""

from __future__ import annotations

import math

import torch
from torch import fx

from tpcompile.core.placement import Shard
from tpcompile.runtime.routed_rows import grouped_mm_rows
from tpcompile.passes.planner.dims import hinted_shape, shape
from tpcompile.passes.planner.rules.table import register
from tpcompile.passes.planner.rules.einsum import replicate_all, einsum_rule

aten = torch.ops.aten


def contraction_flops(first: int):
    """2·M·N·K of a matmul whose two operands start at ``args[first]`` (K: the first operand's
    last dim, M·N: the output's elements); either operand's shard divides them."""
    def flops(node: fx.Node) -> tuple[float, list[fx.Node]]:
        a = hinted_shape(node.args[first])
        operands = [x for x in node.args[first:first + 2] if isinstance(x, fx.Node)]
        return 2.0 * math.prod(hinted_shape(node)) * (a[-1] if a else 0), operands
    return flops


@register(aten.linear.default, matmul=True, weight_out_first=True, flops=contraction_flops(0))
def _linear(op):
    x, w = op.node.args[0], op.node.args[1]
    n = len(shape(x))
    x_labels = list(range(n - 1)) + ["k"]
    out_labels = list(range(n - 1)) + ["n"]
    operands = [(x, x_labels), (w, ["n", "k"])]
    bias = len(op.node.args) > 2 and op.node.args[2] is not None
    if bias:
        operands.append((op.node.args[2], ["n"]))
    # x @ w.T + b is affine, not linear: with a bias no rank may add its own copy of it to a
    # partial sum (split_bias_pass leaves the planner bias-free linears anyway)
    return einsum_rule(op, operands, out_labels, linear=None if bias else "mul", matmul=True)


def _matmul_labels(sa, sb):
    """Labels for torch.matmul semantics (1-D operands, broadcast batch dims)."""
    na, nb = len(sa), len(sb)
    a = ["m", "k"] if na >= 2 else ["k"]
    b = ["k", "n"] if nb >= 2 else ["k"]
    batch = max(na, nb) - 2
    a = [f"b{batch - (na - 2) + i}" for i in range(na - 2)] + a
    b = [f"b{batch - (nb - 2) + i}" for i in range(nb - 2)] + b
    out = [f"b{i}" for i in range(max(batch, 0))] + (["m"] if na >= 2 else []) + (["n"] if nb >= 2 else [])
    # broadcast batch dims of size 1 carry no label
    a = [None if lab.startswith("b") and sa[i] == 1 else lab for i, lab in enumerate(a)]
    b = [None if lab.startswith("b") and sb[i] == 1 else lab for i, lab in enumerate(b)]
    return a, b, out


def _matmul_of(op, x, w):
    a, b, out = _matmul_labels(shape(x), shape(w))
    return einsum_rule(op, [(x, a), (w, b)], out, linear="mul", matmul=True)


# ``_int_mm``: int8 operands, int32 sums (exact, so a partial sum of them is one)
@register(aten.matmul.default, aten.mm.default, aten.bmm.default, aten._int_mm.default, matmul=True,
          flops=contraction_flops(0))
def _matmul(op):
    return _matmul_of(op, op.node.args[0], op.node.args[1])


@register(torch.ops.higher_order.out_dtype, matmul=True, flops=contraction_flops(2))
def _out_dtype(op):
    """``out_dtype(mm, int32, x, w)``: torchao's integer matmul off the CPU (int8 operands
    summed in int32, exactly), planned as the matmul it wraps; any other wrapped op whole."""
    inner, _, *operands = op.node.args
    if inner not in (aten.mm.default, aten.matmul.default, aten.bmm.default) or len(operands) != 2:
        return replicate_all(op)
    return _matmul_of(op, *operands)


def _einsum_labels(equation: str, operands: list) -> tuple[list, list]:
    """Per-operand labels and output labels of an einsum equation (``...`` expanded)."""
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if not rhs and "->" not in equation:  # implicit output: labels seen once, sorted
        letters = "".join(terms).replace(".", "")
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        if "..." in lhs:
            rhs = "..." + rhs
    width = max((len(shape(a)) - len(t.replace("...", "")) for a, t in zip(operands, terms)
                 if "..." in t), default=0)
    ellipsis = [f"...{i}" for i in range(width)]

    def expand(term, ndim=None):
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        n = (ndim - len(head) - len(tail)) if ndim is not None else width
        return list(head) + ellipsis[width - n:] + list(tail)

    labels = [expand(t, len(shape(a))) for a, t in zip(operands, terms)]
    labels = [[None if (lab.startswith("...") and shape(a)[d] == 1) else lab
               for d, lab in enumerate(ls)] for a, ls in zip(operands, labels)]
    return labels, expand(rhs)


@register(aten.einsum.default, matmul=True)
def _einsum(op):
    """Any equation: its letters are the labels :func:`einsum_rule` reads."""
    equation, operands = op.node.args[0], list(op.node.args[1])
    labels, out = _einsum_labels(equation, operands)
    linear = "mul" if len(operands) > 1 else "unary"
    return einsum_rule(op, list(zip(operands, labels)), out, linear=linear, matmul=True)


def _localize_grouped_mm(node, local):
    """Whole experts per rank (the weight arrives cut on its expert dim): the rank multiplies
    only the rows routed to its experts (:mod:`tpcompile.runtime.routed_rows`)."""
    p = local.consumed(node.args[1], node)
    if not (isinstance(p, Shard) and p.dim == 0):
        return
    ((first, last),) = local.specs.ranges(p.layout)[local.rank]
    kwargs = dict(node.kwargs)
    offs = node.args[2] if len(node.args) > 2 else kwargs.pop("offs")
    local.replace_target(node, grouped_mm_rows,
                         (node.target, node.args[0], node.args[1], offs, first, last))
    node.kwargs = kwargs


@register(aten._grouped_mm.default, "transformers::grouped_mm_fallback", matmul=True,
          grouped=True, localize=_localize_grouped_mm)
def _grouped_mm(op):
    """Mixture-of-experts grouped matmul: rows of ``x`` (t, k) in expert groups (``offs``), group
    ``e`` times ``w[e]`` (e, k, n). A cut of ``n`` keeps each expert's output columns local
    (column-parallel experts), a cut of ``k`` gives partial sums (row-parallel); the expert dim
    is a selection, not a sum, so it carries no label and propagation never cuts it. Whole
    experts per rank are planned on that column -> row chain, then moved onto the expert dim
    (:mod:`tpcompile.passes.planner.experts.grouped`); this rule records which is asked."""
    x, w = op.node.args[0], op.node.args[1]
    if len(shape(x)) != 2 or len(shape(w)) != 3:
        return replicate_all(op)
    operands = [(x, ["t", "k"]), (w, [None, "k", "n"])]
    out = einsum_rule(op, operands, ["t", "n"], linear="mul", matmul=True)
    if isinstance(out, Shard) and op.param_behind(w) is not None:
        op.place_grouped_experts(w)
    return out


# where each convolution overload takes ``groups``
_CONV_GROUPS_ARG = {aten.convolution.default: 8, aten.conv1d.default: 6, aten.conv1d.padding: 6,
                    aten.conv2d.default: 6, aten.conv2d.padding: 6, aten.conv3d.default: 6}


def _conv_groups(node: fx.Node) -> int:
    i = _CONV_GROUPS_ARG[node.target]
    return node.args[i] if len(node.args) > i else node.kwargs.get("groups", 1)


def _conv_channel_dim(node: fx.Node) -> int:
    """The channel dim of the input: weights are (out, in / groups, *kernel), inputs
    ((batch,) channels, *spatial)."""
    return len(shape(node.args[0])) - (len(shape(node.args[1])) - 1)


def _localize_conv(node, local):
    """A depthwise convolution on a channel shard has one group per local channel."""
    (p,) = local.out_placements(node)
    if isinstance(p, Shard) and p.dim == _conv_channel_dim(node) and _conv_groups(node) > 1:
        i = _CONV_GROUPS_ARG[node.target]
        if len(node.args) > i:
            local.set_arg(node, i, local.local_size(p))
        else:
            node.kwargs = {**node.kwargs, "groups": local.local_size(p)}


@register(*_CONV_GROUPS_ARG, localize=_localize_conv)
def _convolution(op):
    """Convolutions mix neighbours along spatial dims, so those are never cut (a shard would
    need its neighbours' halo). Over channels a convolution is a matmul: with one group the
    input channels are contracted (a shard of them gives partial sums, the weight cut on its
    dim 1), and a depthwise one (groups = in = out channels: the causal conv1d of Mamba and
    linear-attention layers) filters each channel alone, so a channel shard passes, the
    weight and bias cut alike. Other groupings run whole."""
    x, w = op.node.args[0], op.node.args[1]
    bias = op.node.args[2] if len(op.node.args) > 2 else op.node.kwargs.get("bias")
    sx, sw, so = shape(x), shape(w), shape(op.node)
    c, spatial = _conv_channel_dim(op.node), len(sw) - 2
    groups = _conv_groups(op.node)
    transposed = op.node.target == aten.convolution.default and op.node.args[6]
    kept = list(range(c))  # the batch dim, if any
    if groups == 1:  # a transposed convolution's weight is (in, out, *kernel)
        x_labels, w_labels, out = kept + ["k"], ["k", "n"] if transposed else ["n", "k"], kept + ["n"]
    elif groups == sx[c] == so[c] and sw[1] == 1:
        x_labels, w_labels, out = kept + ["c"], ["c", None], kept + ["c"]
    else:
        return replicate_all(op)
    operands = [(x, x_labels + [None] * spatial), (w, w_labels + [None] * spatial)]
    if bias is not None:
        operands.append((bias, [out[-1]]))
    out = out + [f"s{d}" for d in range(spatial)]
    return einsum_rule(op, operands, out, linear=None if bias is not None else "mul")
