"""The table itself: :class:`Rule`, ``RULES``, :func:`register` and the look-ups.

Everything tpcompile knows about an ATen op is a field of its rule, so the rule modules
(``views``, ``matmuls``, ...) import :func:`register` from here and every other module asks
through the accessors below (:func:`rule_for`, :func:`is_param_matmul`, ...). Keeping the table
apart from the package's ``__init__`` lets the rule modules import it in any order: nothing
here depends on which of them has run.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from tpcompile.passes.planner.dims import shape
from tpcompile.passes.planner.rules.einsum import tensor_args

__all__ = ["Rule", "RULES", "TAGGED", "register", "rule_for", "rule_for_target",
           "is_view", "viewed_from", "shard_map",
           "is_param_matmul", "is_lookup", "weight_out_first", "is_grouped_matmul", "is_attention",
           "flops_of", "piece_of", "ZERO_FILLED", "zero_filled", "is_sum",
           "scales"]


@dataclass(frozen=True)
class Rule:
    """How an op propagates placements (``propagate``) and rewrites its shape constants for a
    rank (``localize``), plus the facts other passes ask about it:

    - ``maps(node, shard)``: for ops that only move, split or merge dims (views), where a
      shard of the input lands in the output (None: it is cut up). The planner uses it to
      store a parameter sharded when only a view of it (``w.t()``, ``w.view(...)``) meets a
      matmul.
    - ``elementwise``: each output element depends on its own input element alone (and no
      random draw), so slicing commutes with the op.
    - ``carries(node, shard)``: like ``maps`` for ops that are no views but still carry a
      shard of a dim they do not index (``embedding``'s table columns, ``index``'s unpicked
      dims): a parameter read through them may be stored sharded too, but they start no
      column-parallel root as a view of a weight would.
    - ``decomposition``: the op written in ops the table knows, with the op's signature; the
      planner plans a node through it when its rule asks (``op.decompose``).
    - ``matmul``: its parameter operand may start a column-parallel root.
    - ``lookup``: it reads a table's rows by index (a table cut by rows is vocabulary
      parallel).
    - ``weight_out_first``: its weight is stored (out features, in features), so a column cut
      splits dim 0 (``linear``).
    - ``grouped``: a grouped (expert) matmul, ``(x, w, offs)``: the rows of ``x`` are sorted
      by expert and ``offs`` ends each expert's group; ``w`` stacks the experts on dim 0.
    - ``attention``: scaled-dot-product attention, ``(query, key, value, ...)``: its key and
      value are what a KV cache holds.
    - ``splits``: it cuts its first input into consecutive pieces along ``args[2]`` (default
      0), each read through ``getitem`` (``split``, ``chunk``): a matmul reading one piece of
      a parameter (``nn.MultiheadAttention``'s q rows and k / v rows of ``in_proj_weight``
      for cross-attention) shards it as that part of the parameter's cut (:func:`piece_of`).
    - ``keeps_zeros``: a zero-filled first input gives a zero-filled output (gathers of its
      rows: ``zeros[idx]``), as views do; see :func:`zero_filled`.
    - ``flops(node)``: ``(FLOPs, operands)`` of one whole call, for the cost model: the
      operands whose shard divides them (None: not counted, as elementwise ops and norms).
    - ``sums``: its output is the (signed, scaled) sum of its tensor operands and nothing else
      (``add``, ``sub``): a replicated operand may enter it as rank 0's share of a partial sum
      (zeros on the other ranks), so a sum of row-parallel outputs and a residual stays
      partial and is reduced once (:mod:`tpcompile.passes.planner.refine.carried_sums`).
    - ``extremal``: it reads a max / min partial (``Partial("max")``) as it is, passing it on
      where the max commutes with the op (:mod:`.extrema`); every other rule reads such a
      partial all-reduced first.
    - ``scales``: its output is its one data operand times numbers every rank shares (a
      clone, a floating cast, a product with a number; dropout, whose mask every rank draws
      alike: :mod:`tpcompile.runtime.rng`): a carried sum passes through it into the next
      sum of its tree (GPT-J's ``dropout(fc_out(h)) + dropout(attn(h)) + x``).
    """
    propagate: Callable
    localize: Callable | None = None
    maps: Callable | None = None
    elementwise: bool = False
    carries: Callable | None = None
    decomposition: Callable | None = None
    matmul: bool = False
    lookup: bool = False
    weight_out_first: bool = False
    grouped: bool = False
    attention: bool = False
    splits: bool = False
    flops: Callable | None = None
    keeps_zeros: bool = False
    sums: bool = False
    extremal: bool = False
    scales: bool = False


RULES: dict = {}
TAGGED: dict = {}  # torch.Tag -> the rule of an op torch tags so that has no entry of its own


def register(*targets, **facts):
    """``@register(aten.op.default, ..., localize=..., matmul=True)``: ``fn`` propagates
    through every target; ``facts`` are the other fields of :class:`Rule`."""
    def deco(fn):
        for t in targets:
            RULES[t] = Rule(fn, **facts)
        return fn
    return deco


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
    # any other op torch tags (sin, erfinv: pointwise) and that neither draws nor writes
    tags = target.tags
    if torch.Tag.nondeterministic_seeded in tags or target._schema.is_mutable:
        return None
    return next((TAGGED[tag] for tag in tags if tag in TAGGED), None)


def is_view(node: fx.Node) -> bool:
    """An op that only moves, splits or merges dims of its first input (its rule ``maps``)."""
    rule = rule_for(node)
    return rule is not None and rule.maps is not None and bool(node.args)


def viewed_from(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` is a view of, nearest first (empty when it is no view)."""
    out = []
    while is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        out.append(node)
    return out


def shard_map(node: fx.Node) -> Callable | None:
    """Where a shard of ``node``'s first input lands in its output, for ops that carry it whole:
    views (their ``maps``), lookups (``carries``) and elementwise ops of one tensor that keep
    its shape (the shard stays where it is). None for every other op."""
    rule = rule_for(node)
    if rule is None or not node.args:
        return None
    if (carried := rule.maps or rule.carries) is not None:
        return carried
    if rule.elementwise and len(tensor_args(node)) == 1 and shape(node) == shape(node.args[0]):
        return lambda node, shard: shard
    return None


# factories of zero-filled tensors
ZERO_FILLED = frozenset({torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default,
                         torch.ops.aten.new_zeros.default})


def zero_filled(node) -> bool:
    """``node`` is all zeros whatever the inputs: a zero factory, or a view or gather
    (``keeps_zeros``) of one. A replicated zero tensor is every placement at once (each
    rank's zeros sum to zeros), so a sum may read it as a partial sum: ``y[idx] += v`` into
    ``y = zeros_like(x)`` (litgpt's expert loop) adds ``v`` to ``zeros[idx]``."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        if node.target in ZERO_FILLED:
            return True
        if not (is_view(node) or _fact(node, "keeps_zeros")):
            return False
        node = node.args[0]
    return False


def _fact(node: fx.Node, name: str):
    rule = rule_for(node)
    return getattr(rule, name) if rule is not None else None


def is_param_matmul(node: fx.Node) -> bool:
    """A matmul whose parameter operand may start a column-parallel root."""
    return bool(_fact(node, "matmul"))


def is_lookup(node: fx.Node) -> bool:
    """Reads a table's rows by index (``embedding``)."""
    return bool(_fact(node, "lookup"))


def weight_out_first(node: fx.Node) -> bool:
    """Its weight is stored (out features, in features): a column cut splits dim 0."""
    return bool(_fact(node, "weight_out_first"))


def is_sum(node: fx.Node) -> bool:
    """Its output is the sum of its tensor operands (``sums``: ``add``, ``sub``)."""
    return bool(_fact(node, "sums"))


def scales(node: fx.Node) -> bool:
    """Its output is its first operand scaled by numbers every rank shares (``scales``)."""
    return bool(_fact(node, "scales"))


def is_grouped_matmul(node: fx.Node) -> bool:
    """A grouped (expert) matmul ``(x, w, offs)``: rows of ``x`` picked per expert by offsets."""
    return bool(_fact(node, "grouped"))


def is_attention(node: fx.Node) -> bool:
    """Scaled-dot-product attention: ``args[1:3]`` are its key and value."""
    return bool(_fact(node, "attention"))


def piece_of(node: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """``(source, dim, start, stop)`` when ``node`` is piece ``[start, stop)`` along ``dim``
    of a split whose every user picks a piece (``w.split([E, 2 * E])[1]``); None otherwise."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    split, idx = node.args
    if not (isinstance(split, fx.Node) and _fact(split, "splits")
            and isinstance(split.args[0], fx.Node) and isinstance(idx, int)
            and all(u.target is operator.getitem for u in split.users)):
        return None
    pieces = split.meta.get("val")
    ndim = len(shape(split.args[0]))
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    dim = dim + ndim if dim < 0 else dim
    sizes = [p.shape[dim] for p in pieces[:idx + 1]]
    if not all(isinstance(s, int) for s in sizes):
        return None  # sizes known only when run (tokens split by their expert counts)
    return split.args[0], dim, sum(sizes[:-1]), sum(sizes)


def flops_of(node: fx.Node) -> tuple[float, list[fx.Node]]:
    """The whole (unsharded) FLOPs of one call of ``node`` and the operands whose shard divides
    them; (0, []) for an op the cost model does not count."""
    count = _fact(node, "flops")
    return count(node) if count is not None else (0.0, [])
