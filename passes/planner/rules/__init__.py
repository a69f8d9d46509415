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

The table (:class:`Rule`, ``RULES``, :func:`register` and the accessors other modules ask:
:func:`rule_for`, :func:`is_param_matmul`, :func:`is_lookup`, ...) is :mod:`.table`; the rules
are spread over this package's modules by kind of op, each registering its rules there when
the package imports it:

- ``einsum``: :func:`einsum_rule` and the operand labels the other modules share
- ``pointwise``: elementwise ops, casts, dropout, division and their in-place variants
- ``writes``: in-place writes, KV-cache writes (``index_put_``, ``index_copy_``), fresh buffers
- ``matmuls``: ``linear``, ``matmul`` / ``mm`` / ``bmm``, ``einsum``, grouped matmuls, convolutions
- ``indexing``: complex views, ``constant_pad_nd``, advanced indexing, ``stack``
- ``attention``: ``scaled_dot_product_attention``
- ``flex_attention``: the ``flex_attention`` higher-order op, its mods given global head indices
- ``reductions``: sums, means, max / var / topk, softmax, vector norms, cumulative sums
- ``norms``: layer / RMS norms (over a cut feature dim: through means), group norms
- ``extrema``: ``amax`` / ``amin`` over a cut dim as a max / min partial, and the ops passing it
- ``views``: shape ops (view, transpose, permute, slice, split, unbind, getitem, cat)
- ``dim_maps``: where each shape op puts a shard of its input (its rule's ``maps``)
- ``vocabulary``: vocabulary-parallel embedding and cross entropy

Beside the table, registering nothing: ``quantized``, the graph facts of weight-only quantized
weights (which stored tensor is quantized, which matmul reads it dequantized), asked by the
table's users as they ask :func:`is_param_matmul`.
"""

from tpcompile.passes.planner.rules.table import (
    RULES, TAGGED, Rule, flops_of, is_grouped_matmul, is_lookup, is_param_matmul, is_attention,
    is_sum, is_view, piece_of, register, rule_for, rule_for_target, scales, shard_map,
    viewed_from, weight_out_first,
)
from tpcompile.passes.planner.rules import (  # each registers its rules into the table
    einsum, pointwise, writes, matmuls, indexing, attention, flex_attention, varlen_attention,
    reductions, norms, extrema, views, vocabulary,
)
from tpcompile.passes.planner.rules.einsum import einsum_rule
from tpcompile.passes.planner.rules.matmuls import contraction_flops
from tpcompile.passes.planner.rules.writes import (
    FRESH_BUFFERS, SCATTERS, cache_behind, value_of_write,
)

__all__ = ["Rule", "RULES", "TAGGED", "register", "rule_for", "rule_for_target", "is_view",
           "viewed_from", "shard_map", "is_param_matmul", "is_lookup", "weight_out_first",
           "is_grouped_matmul", "is_attention", "is_sum", "scales", "flops_of", "piece_of",
           "einsum_rule", "contraction_flops", "cache_behind", "FRESH_BUFFERS", "SCATTERS",
           "value_of_write", "einsum", "pointwise", "writes", "matmuls", "indexing", "attention",
           "flex_attention", "reductions", "norms", "extrema", "views", "vocabulary"]
