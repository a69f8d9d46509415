"""``torch.nn.attention.varlen`` attention (packed sequences): cut by heads like SDPA.

``varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, ...)`` (torchtitan's varlen
attention, its gpt-oss) is exported as the custom op ``torch_attn::_varlen_attn`` on
``(tokens, heads, head_dim)`` tensors: the batch's sequences packed end to end, their bounds in
the cumulative lengths. It returns ``(out, lse, rng_state)``: ``out`` like ``q``, the
log-sum-exp ``(heads, tokens)``. Heads are independent, so q, k and v cut alike on the heads
(kv heads with their group of query heads under ``enable_gqa``, as
:func:`.attention.grouped_heads` places them) keep ``out`` cut on dim 1 and ``lse`` on dim 0;
the cumulative lengths, a paged cache's block table and the rng state are read or made whole.
Tokens are never cut here: a sequence's tokens are found by the global cumulative lengths.
"""

from __future__ import annotations

import math

from torch import fx

from tpcompile.core.placement import Replicate, Shard
from tpcompile.passes.planner.dims import hinted_shape, shape
from tpcompile.passes.planner.rules.attention import grouped_heads, kv_read_whole
from tpcompile.passes.planner.rules.einsum import einsum_rule
from tpcompile.passes.planner.rules.table import register

HEADS = -2  # (tokens, heads, head_dim)


def _varlen_flops(node: fx.Node) -> tuple[float, list[fx.Node]]:
    """2·max_k·(numel(q) + numel(out)): each query token's scores against at most ``max_k``
    keys and their product with v; a shard of q (its heads) divides them."""
    q = node.args[0]
    max_k = node.args[6] if len(node.args) > 6 else node.kwargs.get("max_k", 0)
    return 2.0 * float(max_k) * 2 * math.prod(hinted_shape(q)), [q]


@register("torch_attn::_varlen_attn", attention=True, flops=_varlen_flops)
def _varlen(op):
    """q cut by heads: k, v on the kv heads those read, the rest whole; ``out`` cut like q,
    ``lse`` on its heads (dim 0), the rng state whole. Anything else: all whole."""
    q, k, v = op.node.args[:3]
    for t in op.node.all_input_nodes:
        if t not in (q, k, v):
            op.require(t, Replicate())
    pq = op.placement(q)
    if not (isinstance(pq, Shard) and pq.dim == len(shape(q)) + HEADS):
        for t in (q, k, v):
            op.require(t, Replicate())
        return [Replicate()] * 3
    kv_read_whole(op, q, k, v, HEADS)
    if shape(q)[HEADS] != shape(k)[HEADS]:
        layout = grouped_heads(op, q, k, v, [], HEADS)
    else:
        heads = [None, "h", None]
        out = einsum_rule(op, [(x, heads) for x in (q, k, v)], heads)
        if not isinstance(out, Shard):
            return [out, Replicate(), Replicate()]
        layout = out.layout
    return [Shard(1, layout), Shard(0, layout), Replicate()]
