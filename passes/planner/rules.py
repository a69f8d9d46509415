"""The one table of per-op sharding rules.

Each entry maps ATen overloads to a :class:`Rule`: ``propagate(op)`` reads the placements of the
op's inputs (``op.placement(arg)``), asks for conversions of inputs it cannot take as they are
(``op.require(arg, placement)``: gathers, all-reduces, local slices) and returns the placement
of the output; ``localize(node, local)`` rewrites the shape constants a shard changes
(``view(B, T, 8, 16)`` -> ``view(B, T, 4, 16)``). Ops missing from the table are handled by the
propagation engine as "replicated": sharded inputs are gathered, and the fallback is recorded
so ``explain`` can show it.

Most ops are einsum-like and share :func:`einsum_rule`: every dimension has a label, a sharded
label that survives into the output keeps the output sharded, a sharded label that is summed
over makes the output Partial. ``linear`` says how Partial inputs pass through: ``"add"`` (all
tensor operands Partial: a sum of partial sums), ``"mul"`` (exactly one operand Partial: the op
is linear in it), ``"unary"`` (one operand) or ``None`` (Partial inputs are all-reduced first).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import fx

from tpcompile.core.placement import Layout, Partial, Replicate, Shard
from tpcompile.runtime.partial import mean_term
from tpcompile.runtime.rng import per_rank_sdpa, sharded_dropout
from tpcompile.runtime.vocab import vocab_parallel_cross_entropy, vocab_parallel_embedding
from tpcompile.passes.planner.dims import (
    chunk_layout, merge_layout, norm_dim, shape, split_layout, sub_layout, tile_layout,
    untile_layout, val, view_groups,
)

aten = torch.ops.aten

__all__ = ["Rule", "RULES", "PARAM_MATMULS", "LOOKUPS", "OUT_FEATURES_FIRST", "is_view", "shard_map", "rule_for",
           "rule_for_target", "einsum_rule", "cache_behind"]


@dataclass(frozen=True)
class Rule:
    """``maps(node, shard)``: for ops that only move, split or merge dims (views), where a
    shard of the input lands in the output (None: it is cut up). The planner uses it to store
    a parameter sharded when only a view of it (``w.t()``, ``w.view(...)``) meets a matmul.
    ``elementwise``: each output element depends on its own input element alone (and no
    random draw), so slicing commutes with the op."""
    propagate: Callable
    localize: Callable | None = None
    maps: Callable | None = None
    elementwise: bool = False


RULES: dict = {}
PARAM_MATMULS: set = set()  # ops whose parameter operand may start a column-parallel root
LOOKUPS = frozenset({aten.embedding.default})  # read a table's rows by index (vocabulary parallel)
OUT_FEATURES_FIRST = frozenset({aten.linear.default})  # weight (out, in): a column cut splits dim 0


def register(*targets, localize=None, maps=None, matmul=False, elementwise=False):
    def deco(fn):
        for t in targets:
            RULES[t] = Rule(fn, localize, maps, elementwise)
            if matmul:
                PARAM_MATMULS.add(t)
        return fn
    return deco


def is_view(node: fx.Node) -> bool:
    """An op that only moves, splits or merges dims of its first input (its rule ``maps``)."""
    rule = rule_for(node)
    return rule is not None and rule.maps is not None and bool(node.args)


def shard_map(node: fx.Node) -> Callable | None:
    """Where a shard of ``node``'s first input lands in its output, for ops that carry it whole:
    views (their ``maps``) and elementwise ops of one tensor that keep its shape (the shard
    stays where it is). None for every other op."""
    rule = rule_for(node)
    if rule is None or not node.args:
        return None
    if rule.maps is not None:
        return rule.maps
    if rule.elementwise and len(_tensor_args(node)) == 1 and shape(node) == shape(node.args[0]):
        return lambda node, shard: shard
    return None


def rule_for(node: fx.Node) -> Rule | None:
    return rule_for_target(node.target) if node.op == "call_function" else None


def rule_for_target(target) -> Rule | None:
    if target in RULES:
        return RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet in RULES:
        return RULES[packet]
    if not isinstance(target, torch._ops.OpOverload):
        return None
    # ops of other libraries (transformers' MoE kernels) are registered by name: the table
    # must not import them
    if target.name() in RULES:
        return RULES[target.name()]
    # any other elementwise op (sin, erfinv, ...): torch tags it; shards pass, partials reduce
    tags = target.tags
    if (torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags
            and not target._schema.is_mutable):
        return _TAGGED_POINTWISE
    return None


# --------------------------------------------------------------------------- einsum core

def einsum_rule(op, operands, out_labels, linear=None, matmul=False):
    """Propagate through an op whose operand dims carry labels (see module docstring).

    ``operands``: [(arg, labels)] with one label per dim (None: a broadcast size-1 dim).
    ``matmul``: a parameter operand (or a view of one) with a label that only it and the
    output carry may start a column-parallel root when every operand is replicated.
    With sequence parallelism, replicated and partial activations are put on sequence shards
    (partial ones by a reduce-scatter) and column-parallel matmuls gather their input first.
    """
    sharded, partial = [], []
    for i, (arg, labels) in enumerate(operands):
        p = op.placement(arg)
        if isinstance(p, Shard):
            sharded.append((i, labels[p.dim], p.layout))
        elif isinstance(p, Partial):
            partial.append(i)
    seq = op.sequence_label(out_labels)
    if partial and not sharded:
        if linear == "add" and len(partial) == len([o for o in operands if op.is_tensor(o[0])]):
            return Partial()
        if linear in ("mul", "unary") and len(partial) == 1:
            return Partial()
        if seq is None or not all(seq in operands[i][1] for i in partial):
            for i in partial:
                op.require(operands[i][0], Replicate())
            return Replicate()
        sharded = [(i, seq, op.sequence_layout()) for i in partial]  # reduce-scatter them
    if not sharded:
        column = op.maybe_column_parallel(operands, out_labels) if matmul else None
        if column is not None or seq is None:
            return column or Replicate()
        sharded = [(None, seq, op.sequence_layout())]  # replicated activation -> sequence shards
    label = sharded[0][1]
    if label is None:  # sharded along a dim the op does not map (e.g. a broadcast size-1 dim)
        for arg, _ in operands:
            op.require(arg, Replicate())
        return Replicate()
    if label == seq and len(sharded) == len([s for s in sharded if s[1] == seq]):
        column = op.gather_for_column(operands, out_labels) if matmul else None  # Megatron-SP
        if column is not None:
            return column
    for i, lab, _ in sharded[1:]:
        if lab != label:  # a second sharded label: gather that operand
            op.require(operands[i][0], Replicate())
    same = [(operands[i][0], layout) for i, lab, layout in sharded if lab == label and i is not None]
    target = op.unify(same) if same else sharded[0][2]
    contracted = label not in out_labels
    if contracted and (linear != "mul" or op.overlaps(target)):
        # a non-linear reduction over a sharded dim (softmax over heads' dim, norms) or a
        # sum over replicated blocks: both need the whole dim on every rank
        for arg, _ in same:
            op.require(arg, Replicate())
        return Replicate()
    for i, (arg, labels) in enumerate(operands):
        if label in labels:  # replicated operands are sliced, partial ones reduce-scattered
            op.require(arg, Shard(labels.index(label), target))
        elif i in partial:
            op.require(arg, Replicate())
    if contracted:
        return Partial()
    return Shard(out_labels.index(label), target)


def _broadcast_labels(args, out_shape):
    """Right-aligned labels for pointwise operands; broadcast size-1 dims get None."""
    n = len(out_shape)
    result = []
    for a in args:
        s = shape(a)
        labels = []
        for d, size in enumerate(s):
            o = d + n - len(s)
            labels.append(None if (isinstance(size, int) and size == 1 and out_shape[o] != 1) else o)
        result.append((a, labels))
    return result


def _replicate_all(op):
    """The op runs on whole tensors: every tensor input is gathered / reduced first."""
    for a in _tensor_args(op.node):
        op.require(a, Replicate())
    return Replicate()


def _tensor_args(node):
    flat = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            flat.extend(x for x in a if isinstance(x, fx.Node))
        elif isinstance(a, fx.Node):
            flat.append(a)
    return [a for a in flat if isinstance(val(a), torch.Tensor)]


def _pointwise(linear):
    def propagate(op):
        out = shape(op.node)
        tensors = _tensor_args(op.node)
        operands = _broadcast_labels(tensors, out)
        # a sum of partial sums is one; partial + a number would add the number on every rank
        kind = None if linear == "add" and len(tensors) < 2 else linear
        return einsum_rule(op, operands, list(range(len(out))), kind)
    return propagate


UNARY_LINEAR = [
    aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.mul.Scalar, aten.div.Scalar, aten.lift_fresh_copy.default,
]
POINTWISE = [
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default,
    aten.sigmoid.default, aten.exp.default, aten.log.default, aten.rsqrt.default,
    aten.sqrt.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.where.self, aten.add.Scalar, aten.sub.Scalar,
    aten.bitwise_not.default, aten.abs.default, aten.erf.default, aten.reciprocal.default,
    aten.softplus.default, aten.leaky_relu.default, aten.elu.default, aten.hardtanh.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.gt.Scalar,
    aten.logical_not.default, aten.clamp.default, aten.ones_like.default,
    aten.zeros_like.default, aten.full_like.default, aten.empty_like.default,
]
register(*UNARY_LINEAR, elementwise=True)(_pointwise("unary"))
# rule_for_target: ops torch tags pointwise (and not random)
_TAGGED_POINTWISE = Rule(_pointwise(None), elementwise=True)


@register(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default,
          elementwise=True)
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


register(aten.dropout.default, localize=_localize_dropout)(_pointwise("unary"))
register(*POINTWISE, elementwise=True)(_pointwise(None))
register(aten.add.Tensor, aten.sub.Tensor, operator.add, operator.sub, elementwise=True)(_pointwise("add"))
register(aten.mul.Tensor, operator.mul, elementwise=True)(_pointwise("mul"))


@register(aten.div.Tensor, operator.truediv)
def _divide(op):
    """Linear in the dividend only: a partial divisor is reduced first."""
    divisor = op.node.args[1]
    partial = isinstance(divisor, fx.Node) and isinstance(op.placement(divisor), Partial)
    return _pointwise(None if partial else "mul")(op)


def _in_place(propagate, into_cache=False):
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
            for a in _tensor_args(op.node):
                op.require(a, Replicate())
            return Replicate()
        return out
    return rule


IN_PLACE = {  # in-place overload -> the out-of-place overload whose rule it follows
    aten.relu_.default: aten.relu.default, aten.gelu_.default: aten.gelu.default,
    aten.silu_.default: aten.silu.default, aten.tanh_.default: aten.tanh.default,
    aten.sigmoid_.default: aten.sigmoid.default, aten.hardtanh_.default: aten.hardtanh.default,
    aten.leaky_relu_.default: aten.leaky_relu.default, aten.elu_.default: aten.elu.default,
    aten.clamp_.default: aten.clamp.default, aten.exp_.default: aten.exp.default,
    aten.neg_.default: aten.neg.default, aten.masked_fill_.Scalar: aten.masked_fill.Scalar,
    aten.add_.Tensor: aten.add.Tensor, aten.add_.Scalar: aten.add.Scalar,
    aten.sub_.Tensor: aten.sub.Tensor, aten.sub_.Scalar: aten.sub.Scalar,
    aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
    aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar,
}
for _op, _like in IN_PLACE.items():
    RULES[_op] = Rule(_in_place(RULES[_like].propagate))


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
    by the positions' shape; a dim the write keeps (heads) carries its shard into the cache."""
    labels = _index_put_labels(op)
    if labels is None or _cut_at_positions(op, labels[0]):
        return _replicate_all(op)  # masks, scattered index tensors, positions cut over ranks
    for i in op.node.args[1]:
        if isinstance(i, fx.Node):
            op.require(i, Replicate())
    return einsum_rule(op, labels, labels[0][1])


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
        return _replicate_all(op)
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
RULES[aten.index_put_.default] = Rule(_in_place(_index_put, into_cache=True))
RULES[aten.index_copy_.default] = Rule(_in_place(_index_copy, into_cache=True))


@register(aten.view_as_complex.default, aten.view_as_real.default)
def _complex_view(op):
    """``(..., 2)`` real <-> ``(...)`` complex: the leading dims keep their positions (they are
    not broadcast-aligned from the right); a shard of the real/imaginary pair is gathered."""
    x = op.node.args[0]
    lead = min(len(shape(x)), len(shape(op.node)))
    return einsum_rule(op, [(x, list(range(lead)) + [None] * (len(shape(x)) - lead))],
                       list(range(lead)) + ["pair"] * (len(shape(op.node)) - lead), "unary")


# --------------------------------------------------------------------------- matmuls

@register(aten.linear.default, matmul=True)
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


@register(aten.matmul.default, aten.mm.default, aten.bmm.default, matmul=True)
def _matmul(op):
    x, w = op.node.args[0], op.node.args[1]
    a, b, out = _matmul_labels(shape(x), shape(w))
    return einsum_rule(op, [(x, a), (w, b)], out, linear="mul", matmul=True)


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


@register(aten._grouped_mm.default, "transformers::grouped_mm_fallback", matmul=True)
def _grouped_mm(op):
    """Mixture-of-experts grouped matmul: rows of ``x`` (t, k) in expert groups (``offs``), group
    ``e`` times ``w[e]`` (e, k, n). A cut of ``n`` keeps each expert's output columns local
    (column-parallel experts), a cut of ``k`` gives partial sums (row-parallel); the expert dim
    is a selection, not a sum, so it carries no label and is never cut."""
    x, w = op.node.args[0], op.node.args[1]
    if len(shape(x)) != 2 or len(shape(w)) != 3:
        return _replicate_all(op)
    operands = [(x, ["t", "k"]), (w, [None, "k", "n"])]
    return einsum_rule(op, operands, ["t", "n"], linear="mul", matmul=True)


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
        return _replicate_all(op)
    operands = [(x, x_labels + [None] * spatial), (w, w_labels + [None] * spatial)]
    if bias is not None:
        operands.append((bias, [out[-1]]))
    out = out + [f"s{d}" for d in range(spatial)]
    return einsum_rule(op, operands, out, linear=None if bias is not None else "mul")


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


@register(aten.index.Tensor)
def _index(op):
    """``x[i0, i1, ...]`` with index tensors (advanced indexing): gathering rows is linear, so a
    partial ``x`` stays partial, and a shard of a dim no index reads moves to its output dim."""
    x, indices = op.node.args[0], list(op.node.args[1])
    n = len(shape(x))
    picked = [d for d, i in enumerate(indices) if i is not None]
    adjacent = picked == list(range(picked[0], picked[-1] + 1)) if picked else True
    width = len(shape(op.node)) - (n - len(picked))
    kept = [d for d in range(n) if d not in picked]
    at = picked[0] if picked and adjacent else 0  # where the index dims land in the output
    out_labels = kept[:at] + [None] * width + kept[at:]
    operands = [(x, [None if d in picked else d for d in range(n)])]
    operands += [(i, [None] * len(shape(i))) for i in indices if i is not None]
    return einsum_rule(op, operands, [lab if lab is not None else f"i{j}"
                                      for j, lab in enumerate(out_labels)], linear="mul")


@register(aten.stack.default)
def _stack(op):
    """``stack`` is ``cat`` of unsqueezed tensors: the new dim carries no shard."""
    tensors = [t for t in op.node.args[0] if isinstance(val(t), torch.Tensor)]
    n = len(shape(op.node))
    dim = norm_dim(op.node.args[1] if len(op.node.args) > 1 else 0, n)
    labels = [d for d in range(n) if d != dim]
    return einsum_rule(op, [(t, labels) for t in tensors],
                       [d if d != dim else "stacked" for d in range(n)], linear="add")


def _localize_sdpa(node, local):
    """Attention dropout on sharded heads draws from a per-rank generator (see tpcompile.runtime.rng)."""
    dropout_p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    (p,) = local.out_placements(node)
    if dropout_p and isinstance(p, Shard):
        local.replace_target(node, per_rank_sdpa, tuple(node.args))
        node.kwargs = {**node.kwargs, "rank": local.rank}


@register(aten.scaled_dot_product_attention.default, localize=_localize_sdpa)
def _sdpa(op):
    """Heads are independent: q, k, v sharded alike on dim 1 keep the output sharded.

    With ``enable_gqa`` k/v hold fewer heads; each kv head must sit with its group of q heads.
    """
    q, k, v = op.node.args[:3]
    mask = op.node.args[3] if len(op.node.args) > 3 else op.node.kwargs.get("attn_mask")
    hq, hk = shape(q)[-3], shape(k)[-3]
    pq = op.placement(q)
    causal = op.node.args[5] if len(op.node.args) > 5 else op.node.kwargs.get("is_causal", False)
    if not (isinstance(pq, Shard) and pq.dim == len(shape(q)) - 3) or hq == hk:
        # is_causal masks by *local* query index: query rows cut by position (sequence
        # parallelism) would each be masked as if they started at 0, so they are gathered
        # labels align from the right: (..., heads, L, E); 3-D inputs have no batch dim
        def labels(x, tail):
            n = len(shape(x))
            return [f"b{n - 3 - i}" for i in range(n - 3)] + tail[max(3 - n, 0):]
        operands = [(q, labels(q, ["h", None if causal else "l", "e"])),
                    (k, labels(k, ["h", "s", "e"])), (v, labels(v, ["h", "s", "f"]))]
        if isinstance(mask, fx.Node):
            names = labels(q, ["h", "l", "s"])[len(shape(q)) - len(shape(mask)):]
            operands.append((mask, [None if s == 1 else lab for lab, s in zip(names, shape(mask))]))
        if hq != hk:  # gqa with q replicated: nothing to align, keep all replicated
            for arg, _ in operands:
                op.require(arg, Replicate())
            return Replicate()
        return einsum_rule(op, operands, labels(q, ["h", "l", "f"]))
    hd = len(shape(k)) - 3
    target = pq.layout
    kv = [op.placement(k), op.placement(v)]
    if hk >= op.specs.world_size and all(isinstance(p, Shard) and p.dim == hd for p in kv):
        # k and v cut from their own weights (wk, wv): each rank's kv heads must be the
        # groups its query heads read, i.e. k repeated hq // hk times lines up with q
        repeated = [merge_layout(p.layout, hq // hk) for p in kv]
        target = op.unify([(q, pq.layout)] + list(zip((k, v), repeated)))
        if all(op.specs.same(target, r) for r in repeated):
            _require_sdpa_heads(op, q, mask, hq, target)
            return Shard(pq.dim, target)
    # each rank slices the kv heads its query heads read (several ranks may read the same)
    group = replace(target, size=hk, scale=target.scale * (hq // hk), rep=1, cover=True)
    for p in kv:  # kv heads that cannot follow the query heads' cut are computed whole
        if isinstance(p, Shard) and not (p.dim == hd and op.specs.same(p.layout, group)):
            op.reject(p.layout.root, f"{hk} kv heads cannot be cut like {hq} query heads over "
                                     f"{op.specs.world_size} ranks: each rank reads whole kv heads")
    op.require(k, Shard(hd, group))
    op.require(v, Shard(hd, group))
    _require_sdpa_heads(op, q, mask, hq, target)
    return Shard(pq.dim, target)


def _require_sdpa_heads(op, q, mask, hq: int, layout: Layout) -> None:
    """q, and a mask with a head dim, on the heads ``layout`` gives each rank."""
    op.require(q, Shard(len(shape(q)) - 3, layout))
    if isinstance(mask, fx.Node) and len(shape(mask)) >= 3 and shape(mask)[-3] == hq:
        op.require(mask, Shard(len(shape(mask)) - 3, layout))


# --------------------------------------------------------------------------- reductions / norms

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
register(aten.cumprod.default, aten.logcumsumexp.default)(
    _last_dims_free(lambda node, n: {norm_dim(node.args[1], n)}))


# --------------------------------------------------------------------------- shape ops

def _shard_of(op, x):
    p = op.placement(x)
    return p if isinstance(p, Shard) else None


def _passthrough_non_shard(op, x):
    """Replicate and Partial flow through shape ops unchanged (they are linear maps)."""
    p = op.placement(x)
    return p if not isinstance(p, Shard) else None


def _local_shape_arg(index):
    """Rewrite the shape list at ``args[index]``: each sharded output dim gets its local size."""
    def localize(node, local):
        sizes = list(node.args[index])
        for d, size in local.sharded_out_dims(node):
            if isinstance(sizes[d], int) and sizes[d] != -1:
                sizes[d] = size
        local.set_arg(node, index, sizes)
    return localize


def _map_view(node, p: Shard):
    """Where a reshape puts the sharded dim: kept, split (the shard goes to the leading part,
    or to the second when the leading part is a chunk index picked apart later: a fused qkv
    viewed as (3, heads, head_dim) and unbound), merged (whole dims in front of the shard make
    tiles: BART's (batch, heads) as batch * heads) or a tiled dim split back; None otherwise."""
    src, dst = shape(node.args[0]), shape(node)
    for gi, gj in view_groups(src, dst) or []:
        if p.dim not in gi:
            continue
        real_in = [d for d in gi if not (isinstance(src[d], int) and src[d] == 1)]
        real_out = [d for d in gj if not (isinstance(dst[d], int) and dst[d] == 1)]
        if not real_out:
            return None
        if len(real_in) == 1 and len(real_out) == 1:
            return Shard(real_out[0], p.layout)
        if p.layout.tiles > 1:  # only (tiles, sharded) again
            return Shard(real_out[1], untile_layout(p.layout)) if (
                len(real_in) == 1 and len(real_out) == 2 and dst[real_out[0]] == p.layout.tiles) else None
        if len(real_in) == 1 and all(isinstance(dst[d], int) for d in real_out[1:]):
            inner = math.prod(dst[d] for d in real_out[1:])
            lead = real_out[0]
            if len(real_out) > 1 and isinstance(dst[lead], int) and _picked_apart(node, lead):
                chunked = chunk_layout(p.layout, dst[lead], dst[real_out[1]],
                                       math.prod(dst[d] for d in real_out[2:]))
                if chunked is not None:
                    return Shard(real_out[1], chunked)
            return Shard(lead, split_layout(p.layout, dst[lead], inner))
        others = [d for d in real_in if d != p.dim]
        if len(real_out) == 1 and all(isinstance(src[d], int) for d in others):
            k = real_in.index(p.dim)
            outer, inner = (math.prod(src[d] for d in part) for part in (real_in[:k], real_in[k + 1:]))
            return Shard(real_out[0], tile_layout(merge_layout(p.layout, inner), outer))
        return None
    return None


def _picked_apart(node: fx.Node, dim: int, depth: int = 4) -> bool:
    """Whether dim ``dim`` of ``node`` is taken apart index by index (unbind, select) by its
    users, following it through ops that only move dims."""
    n = len(shape(node))
    for user in node.users:
        if user.args[0] is not node:
            continue
        if user.target in (aten.unbind.int, aten.select.int):
            if norm_dim(user.args[1] if len(user.args) > 1 else 0, n) == dim:
                return True
        elif depth and is_view(user):
            moved = _maps(user, Shard(dim, Layout("", int(shape(node)[dim]))))
            if moved is not None and _picked_apart(user, moved.dim, depth - 1):
                return True
    return False


VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


@register(*VIEWS, aten.transpose.int, aten.t.default, aten.permute.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
          aten.expand.default, aten.slice.Tensor, aten.select.int,
          aten.repeat_interleave.self_int, aten.unflatten.int, aten.flatten.using_ints,
          aten.numpy_T.default, aten.movedim.int,
          localize=lambda node, local: _localize_dim_op(node, local),
          maps=lambda node, p: _maps(node, p))
def _dim_op(op):
    """Ops that move, add, drop or regroup dims without mixing sharded data across them."""
    x = op.node.args[0]
    other = _passthrough_non_shard(op, x)
    if other is not None:
        return other
    mapped = _maps(op.node, _shard_of(op, x))
    chunk = op.node.target is aten.slice.Tensor and mapped is not None \
        and mapped.layout != op.placement(x).layout
    if mapped is None or (chunk and mapped.layout.size < op.specs.world_size):
        # a chunk too small to split over the ranks would be a replicated block of the root,
        # which no row-parallel consumer can read: gather before it instead
        op.require(x, Replicate())
        return Replicate()
    # a view into (n, inner) needs the root cut in whole units of inner: say so now (a demand
    # the planner adds), not when the rewrite asks for the rank's size
    op.check_aligned(mapped.layout)
    if chunk:
        op.require_block(mapped.layout)  # uneven fused chunks (Phi-3's qkv[..., :q_size])
    return mapped


def _maps(node, p: Shard):
    return (_map_view if node.target in VIEWS else _map_dim)(node, p)


def _map_dim(node, p: Shard):
    """Where the sharded dim of the input goes in the output, or None if it is cut up."""
    t, args = node.target, node.args
    n_in, n_out = len(shape(args[0])), len(shape(node))
    d = p.dim
    if t in (aten.transpose.int, aten.t.default):
        if n_in < 2:  # t() of a vector is the vector
            return p
        a, b = (norm_dim(args[1], n_in), norm_dim(args[2], n_in)) if len(args) > 2 else (0, 1)
        return Shard(b if d == a else a if d == b else d, p.layout)
    if t is aten.permute.default:
        return Shard([norm_dim(x, n_in) for x in args[1]].index(d), p.layout)
    if t is aten.numpy_T.default:  # every dim reversed
        return Shard(n_in - 1 - d, p.layout)
    if t is aten.movedim.int:
        order = list(range(n_in))
        src, dst = norm_dim(args[1], n_in), norm_dim(args[2], n_in)
        order.insert(dst, order.pop(src))
        return Shard(order.index(d), p.layout)
    if t in (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
             aten.expand.default):
        # sizes > 1 keep their order; the sharded dim is the k-th of them on both sides
        src = [i for i, s in enumerate(shape(args[0])) if not (isinstance(s, int) and s == 1)]
        dst_shape = shape(node)
        if t is aten.expand.default:
            # new leading dims and broadcast size-1 dims do not move the sharded dim
            return Shard(d + n_out - n_in, p.layout)
        dst = [i for i, s in enumerate(dst_shape) if not (isinstance(s, int) and s == 1)]
        return Shard(dst[src.index(d)], p.layout)
    if t is aten.slice.Tensor:
        if norm_dim(args[1] if len(args) > 1 else 0, n_in) != d:
            return p
        bounds = _slice_bounds(node, p.layout.size)
        if bounds is None:
            return None
        if bounds == (0, p.layout.size):
            return p
        return Shard(d, sub_layout(p.layout, *bounds)) if (
            p.layout.copies == 1 and p.layout.tiles == 1) else None
    if t is aten.select.int:
        dim = norm_dim(args[1], n_in)
        return None if dim == d else Shard(d - (dim < d), p.layout)
    if p.layout.tiles > 1 and t in (aten.repeat_interleave.self_int, aten.unflatten.int,
                                    aten.flatten.using_ints):
        return None  # the ops below that regroup the sharded dim assume no tiles
    if t is aten.repeat_interleave.self_int:
        dim = norm_dim(args[2], n_in) if len(args) > 2 else None
        if dim != d or not isinstance(args[1], int):
            return p if dim is not None and dim != d else None
        return Shard(d, merge_layout(p.layout, args[1]))
    if t is aten.unflatten.int:
        dim, sizes = norm_dim(args[1], n_in), list(args[2])
        if dim != d:
            return Shard(d + (len(sizes) - 1) * (d > dim), p.layout)
        if any(not isinstance(s, int) or s == -1 for s in sizes[1:]):
            return None
        inner = 1
        for s in sizes[1:]:
            inner *= s
        return Shard(d, split_layout(p.layout, p.layout.size // inner, inner))
    if t is aten.flatten.using_ints:  # start_dim and end_dim default to 0 and -1
        a = norm_dim(args[1] if len(args) > 1 else 0, n_in)
        b = norm_dim(args[2] if len(args) > 2 else -1, n_in)
        if d < a or d > b:
            return Shard(d - (b - a) * (d > b), p.layout)
        if d != a or any(not isinstance(s, int) for s in shape(args[0])[a + 1:b + 1]):
            return None
        inner = 1
        for s in shape(args[0])[a + 1:b + 1]:
            inner *= s
        return Shard(a, merge_layout(p.layout, inner))
    return None


def _slice_bounds(node: fx.Node, size: int) -> tuple[int, int] | None:
    """``[start, stop)`` of a ``slice`` with step 1 and static bounds, clamped as Python does."""
    args = node.args
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    if step != 1 or not all(b is None or isinstance(b, int) for b in (start, end)):
        return None
    start, end = slice(start, end).indices(size)[:2]
    return start, max(start, end)


def _localize_dim_op(node, local):
    if node.target in VIEWS or node.target is aten.expand.default:
        _local_shape_arg(1)(node, local)
    elif node.target is aten.unflatten.int and local.input_sharded_on(node, node.args[1]):
        # the shard lands on the first of the unflattened sizes; shards of other dims change none
        sizes = list(node.args[2])
        (p,) = local.out_placements(node)
        sizes[0] = local.local_size(p)
        local.set_arg(node, 2, sizes)
    elif node.target in SQUEEZES and isinstance(local.consumed(node.args[0], node), Shard):
        # a rank's shard can be 1 long (5 rows over 3 ranks: 2, 2, 1): squeeze only the dims
        # that are 1 long in the whole tensor
        x = node.args[0]
        n = len(shape(x))
        asked = node.args[1] if len(node.args) > 1 else range(n)
        asked = [norm_dim(d, n) for d in (asked if isinstance(asked, (list, tuple, range)) else [asked])]
        dims = [d for d in asked if isinstance(shape(x)[d], int) and shape(x)[d] == 1]
        local.replace_target(node, aten.squeeze.dims, (x, dims))
    elif node.target is aten.slice.Tensor and local.input_sharded_on(
            node, node.args[1] if len(node.args) > 1 else 0):
        # a whole-dim slice keeps the rank's shard; a chunk's bounds become the rank's part of it
        p, (out,) = local.consumed(node.args[0], node), local.out_placements(node)
        start, _ = _slice_bounds(node, p.layout.size)
        node.args = tuple(node.args) + (0, None, None)[len(node.args) - 1:]
        before = local.local_size(Shard(p.dim, sub_layout(p.layout, 0, start))) if start else 0
        local.set_arg(node, 2, before)
        local.set_arg(node, 3, before + local.local_size(out))


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
          localize=lambda node, local: _localize_split(node, local))
def _split(op):
    x = op.node.args[0]
    outs = val(op.node)
    p = op.placement(x)
    if not isinstance(p, Shard):
        return [p] * len(outs)
    n = len(shape(x))
    dim = norm_dim(op.node.args[2] if len(op.node.args) > 2 else 0, n)
    if dim != p.dim:
        return [p] * len(outs)
    if p.layout.tiles > 1:  # chunks of a tiled dim cut across tiles: gathered
        op.require(x, Replicate())
        return [Replicate()] * len(outs)
    chunks, start = [], 0
    for o in outs:
        size = int(o.shape[dim])
        chunk = sub_layout(p.layout, start, start + size)
        op.require_block(chunk)  # a fused qkv weight is sharded per chunk, not contiguously
        chunks.append(Shard(dim, chunk))
        start += size
    return chunks


def _localize_split(node, local):
    dims = local.input_sharded_on(node, node.args[2] if len(node.args) > 2 else 0)
    if not dims:
        return
    sizes = [local.local_size(pl) for pl in local.out_placements(node)]
    local.replace_target(node, aten.split_with_sizes.default, (node.args[0], sizes) + tuple(node.args[2:]))


@register(aten.unbind.int)
def _unbind(op):
    """Unbinding another dim keeps every piece on the input's cut (q, k, v of a fused qkv
    viewed as (B, T, 3, heads, head_dim): each holds the rank's heads); unbinding the sharded
    dim itself would hand each rank whole pieces only some ranks hold: gathered."""
    x = op.node.args[0]
    n, p = len(val(op.node)), op.placement(x)
    if not isinstance(p, Shard):
        return [p] * n
    dim = norm_dim(op.node.args[1] if len(op.node.args) > 1 else 0, len(shape(x)))
    if dim == p.dim:
        op.require(x, Replicate())
        return [Replicate()] * n
    return [Shard(p.dim - (dim < p.dim), p.layout)] * n


@register(operator.getitem)
def _getitem(op):
    src, idx = op.node.args
    p = op.placement(src)
    return p[idx] if isinstance(p, (list, tuple)) else p


@register(aten.cat.default)
def _cat(op):
    tensors = [t for t in op.node.args[0] if isinstance(val(t), torch.Tensor)]
    n = len(shape(op.node))
    dim = norm_dim(op.node.args[1] if len(op.node.args) > 1 else 0, n)
    if any(isinstance(p, Shard) and p.dim == dim for p in map(op.placement, tensors)):
        for t in tensors:  # concatenating along the sharded dim interleaves shards: gather
            op.require(t, Replicate())
        return Replicate()
    operands = [(t, [d if d != dim else None for d in range(len(shape(t)))]) for t in tensors]
    return einsum_rule(op, operands, [d if d != dim else "cat" for d in range(n)], linear="add")


@register(aten._assert_tensor_metadata.default,
          localize=lambda node, local: _localize_metadata_check(node, local))
def _metadata_check(op):
    """Export's dtype/device checks: no output, no need to gather what they look at."""
    return None


def _localize_metadata_check(node, local):
    if isinstance(local.consumed(node.args[0], node), Shard):  # sizes are global: drop them
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "stride")}


# --------------------------------------------------------------------------- vocabulary

_SHAPE_ONLY = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.clone.default,
               aten.contiguous.default, aten.expand.default, aten._to_copy.default}


def _from_inputs(node) -> bool:
    """Indices that come from the caller (token ids), not computed in the model (positions)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SHAPE_ONLY:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder"


def _contiguous(op, layout) -> bool:
    return all(len(r) == 1 for r in op.specs.ranges(layout)) and not op.overlaps(layout)


@register(aten.embedding.default, localize=lambda node, local: _localize_embedding(node, local))
def _embedding(op):
    """A table sharded by vocabulary rows gives a Partial lookup (ids elsewhere read zeros)."""
    w, ids = op.node.args[:2]
    wanted = op.is_param(w) and (w.target in op.constraints.tied or (
        op.options.vocab_parallel and _from_inputs(ids)))
    layout = op.root_layout(w, 0) if wanted else None
    if layout is not None and _contiguous(op, layout):
        op.require(w, Shard(0, layout))
        op.require(ids, Replicate())
        return Partial()
    return _replicate_all(op)


def _localize_embedding(node, local):
    p = local.consumed(node.args[0], node)
    if isinstance(p, Shard):
        (start, stop), = local.specs.ranges(p.layout)[local.rank]
        pad = node.args[2] if len(node.args) > 2 else -1
        local.replace_target(node, vocab_parallel_embedding,
                             (node.args[0], node.args[1], start, stop, pad, p.layout.size))


@register(aten.cross_entropy_loss.default,
          localize=lambda node, local: _localize_cross_entropy(node, local))
def _cross_entropy(op):
    """Logits sharded by vocabulary: a vocabulary-parallel loss, the logits never gathered."""
    x, target = op.node.args[:2]
    args = list(op.node.args) + [None, 1, -100, 0.0][len(op.node.args) - 2:]
    weight, label_smoothing = op.node.kwargs.get("weight", args[2]), op.node.kwargs.get(
        "label_smoothing", args[5])
    p = op.placement(x)
    class_dim = 1 if len(shape(x)) >= 2 else 0
    if (isinstance(p, Shard) and p.dim == class_dim and weight is None and not label_smoothing
            and _contiguous(op, p.layout)):
        op.require(target, Replicate())
        return Replicate()
    return _replicate_all(op)


def _localize_cross_entropy(node, local):
    x, target = node.args[:2]
    p = local.consumed(x, node)
    if not isinstance(p, Shard):
        return
    (start, stop), = local.specs.ranges(p.layout)[local.rank]
    args = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
    reduction = node.kwargs.get("reduction", args[3])
    ignore_index = node.kwargs.get("ignore_index", args[4])
    node.kwargs = {}
    local.replace_target(node, vocab_parallel_cross_entropy,
                         (x, target, p.dim, start, stop, reduction, ignore_index, local.group,
                          p.layout.size))


# --------------------------------------------------------------------------- fresh buffers

# ops that make a new graph-local tensor: writes into one can be made out of place
# (tpcompile.passes.planner.functionalize)
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


def _written_partially(op, base, src) -> bool:
    """A partial ``src`` written into a replicated zero-filled or empty ``base``: the result is
    a partial sum as it is, with no all-reduce of ``src`` first."""
    return (isinstance(op.placement(src), Partial) and isinstance(op.placement(base), Replicate)
            and isinstance(base, fx.Node) and base.target in _ANY_PLACEMENT)


@register(aten.index_add.default)
def _index_add(op):
    """``x.index_add(dim, index, source)``: ``x`` plus ``source``'s rows added at ``index``.
    A sum, so partial ``x`` and ``source`` stay partial (Mixtral's expert loop accumulating
    row-parallel outputs into ``zeros_like``), and a shard of another dim passes."""
    x, _, index, source = op.node.args[:4]
    labels = _index_copy_labels(op)
    if _cut_at_positions(op, labels[0]):
        return _replicate_all(op)
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
        return _replicate_all(op)
    if _written_partially(op, x, src):
        return Partial()
    return einsum_rule(op, written, written[0][1], linear="add")


@register(aten.expand_as.default)
def _expand_as(op):
    """``src.expand_as(x)`` (a ``copy_`` made out of place): ``x`` gives only its shape, so a
    shard of either passes (the other is sliced locally) and a partial ``src`` stays partial."""
    src, x = op.node.args[:2]
    if isinstance(op.placement(src), Partial) and not isinstance(op.placement(x), Shard):
        return Partial()
    out = shape(op.node)
    labels = list(range(len(out)))
    return einsum_rule(op, [(x, labels)] + _broadcast_labels([src], out), labels)
