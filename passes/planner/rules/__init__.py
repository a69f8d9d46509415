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

The table is spread over this package's modules by kind of op; each registers its rules when
the package imports it:

- ``einsum``: :func:`einsum_rule` and the operand labels the other modules share
- ``pointwise``: elementwise ops, casts, dropout, division and their in-place variants
- ``writes``: in-place writes, KV-cache writes (``index_put_``, ``index_copy_``), fresh buffers
- ``matmuls``: ``linear``, ``matmul`` / ``mm`` / ``bmm``, ``einsum``, grouped matmuls, convolutions
- ``indexing``: complex views, ``constant_pad_nd``, advanced indexing, ``stack``
- ``attention``: ``scaled_dot_product_attention``
- ``reductions``: sums, means, max / var / topk, softmax, norms, cumulative sums
- ``views``: shape ops (view, transpose, permute, slice, split, unbind, getitem, cat)
- ``vocabulary``: vocabulary-parallel embedding and cross entropy
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from tpcompile.passes.planner.dims import shape

aten = torch.ops.aten

__all__ = ["Rule", "RULES", "PARAM_MATMULS", "LOOKUPS", "OUT_FEATURES_FIRST", "is_view", "viewed_from", "shard_map", "rule_for",
           "rule_for_target", "einsum_rule", "cache_behind", "FRESH_BUFFERS", "SCATTERS", "value_of_write",
           "einsum", "pointwise", "writes", "matmuls", "indexing", "attention", "reductions", "views",
           "vocabulary"]


@dataclass(frozen=True)
class Rule:
    """``maps(node, shard)``: for ops that only move, split or merge dims (views), where a
    shard of the input lands in the output (None: it is cut up). The planner uses it to store
    a parameter sharded when only a view of it (``w.t()``, ``w.view(...)``) meets a matmul.
    ``elementwise``: each output element depends on its own input element alone (and no
    random draw), so slicing commutes with the op. ``carries(node, shard)``: like ``maps`` for
    ops that are no views but still carry a shard of a dim they do not index (``embedding``'s
    table columns, ``index``'s unpicked dims): a parameter read through them may be stored
    sharded too, but they start no column-parallel root as a view of a weight would.
    ``decomposition``: the op written in ops the table knows, with the op's signature; the
    planner plans a node through it when its rule asks (``op.decompose``: placements the op
    cannot take whole, such as a vector norm over a sharded dim)."""
    propagate: Callable
    localize: Callable | None = None
    maps: Callable | None = None
    elementwise: bool = False
    carries: Callable | None = None
    decomposition: Callable | None = None


RULES: dict = {}
PARAM_MATMULS: set = set()  # ops whose parameter operand may start a column-parallel root
LOOKUPS = frozenset({aten.embedding.default})  # read a table's rows by index (vocabulary parallel)
OUT_FEATURES_FIRST = frozenset({aten.linear.default})  # weight (out, in): a column cut splits dim 0


def register(*targets, localize=None, maps=None, matmul=False, elementwise=False, carries=None,
             decomposition=None):
    def deco(fn):
        for t in targets:
            RULES[t] = Rule(fn, localize, maps, elementwise, carries, decomposition)
            if matmul:
                PARAM_MATMULS.add(t)
        return fn
    return deco


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


# the rule modules register into the table above (they import ``register`` from here), so they
# are imported last; ``_TAGGED_POINTWISE`` is read by rule_for_target, ``_tensor_args`` by shard_map
from tpcompile.passes.planner.rules import (
    einsum, pointwise, writes, matmuls, indexing, attention, reductions, views, vocabulary,
)
from tpcompile.passes.planner.rules.einsum import _tensor_args, einsum_rule
from tpcompile.passes.planner.rules.pointwise import _TAGGED_POINTWISE
from tpcompile.passes.planner.rules.writes import (
    FRESH_BUFFERS, SCATTERS, cache_behind, value_of_write,
)
