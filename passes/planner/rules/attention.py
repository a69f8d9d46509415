"""``scaled_dot_product_attention``: heads are independent, with grouped-query attention's kv
heads kept with their query heads."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import fx

from tpcompile.core.placement import Layout, Replicate, Shard
from tpcompile.runtime.rng import per_rank_sdpa
from tpcompile.passes.planner.dims import hinted_shape, merge_layout, shape
from tpcompile.passes.planner.rules.table import register
from tpcompile.passes.planner.rules.einsum import einsum_rule

aten = torch.ops.aten


def _localize_sdpa(node, local):
    """Attention dropout on sharded heads draws from a per-rank generator (see tpcompile.runtime.rng)."""
    dropout_p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    (p,) = local.out_placements(node)
    if dropout_p and isinstance(p, Shard):
        local.replace_target(node, per_rank_sdpa, tuple(node.args))
        node.kwargs = {**node.kwargs, "rank": local.rank}


def _sdpa_flops(node: fx.Node) -> tuple[float, list[fx.Node]]:
    """2·Lk·(numel(q) + numel(out)): the scores and their product with v, no causal discount;
    a shard of q (its heads) divides them."""
    q, key = node.args[0], node.args[1]
    lk = hinted_shape(key)[-2] if len(hinted_shape(key)) >= 2 else 0
    return 2.0 * lk * (math.prod(hinted_shape(q)) + math.prod(hinted_shape(node))), [q]


@register(aten.scaled_dot_product_attention.default, localize=_localize_sdpa, attention=True,
          flops=_sdpa_flops)
def _sdpa(op):
    """Heads are independent: q, k, v sharded alike on dim 1 keep the output sharded.

    With ``enable_gqa`` k/v hold fewer heads; each kv head must sit with its group of q heads.
    """
    q, k, v = op.node.args[:3]
    mask = op.node.args[3] if len(op.node.args) > 3 else op.node.kwargs.get("attn_mask")
    hq, hk = shape(q)[-3], shape(k)[-3]
    pq = op.placement(q)
    kv_read_whole(op, q, k, v)
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
    per_head = [(mask, len(shape(mask)) - 3)] if isinstance(mask, fx.Node) and \
        len(shape(mask)) >= 3 and shape(mask)[-3] == hq else []
    return Shard(pq.dim, grouped_heads(op, q, k, v, per_head))


def kv_read_whole(op, q, k, v, heads: int = -3) -> None:
    """A fused qkv's k / v chunk cut inside its heads while q is cut by heads (dim ``heads``
    from the end): that chunk is kept whole (a k_proj of its own is handled by
    :func:`grouped_heads`)."""
    pq = op.placement(q)
    if isinstance(pq, Shard) and pq.dim == len(shape(q)) + heads:
        inside = [p.layout for x in (k, v) if isinstance(p := op.placement(x), Shard)
                  and p.dim == len(shape(x)) - 1 and op.is_chunk(p.layout)]
        op.require_whole("k / v are cut inside their heads while the query heads are cut: each "
                         "rank reads whole kv heads", *inside)


def grouped_heads(op, q, k, v, per_head: list[tuple[fx.Node, int]], heads: int = -3) -> Layout:
    """Grouped-query attention with q cut by heads (dim ``heads`` from the end): the layout of
    each rank's query heads, with k and v required on the kv heads those read, and
    ``per_head`` (tensor, heads dim) operands on the query heads."""
    hq, hk = shape(q)[heads], shape(k)[heads]
    pq = op.placement(q)
    hd = len(shape(k)) + heads
    target = pq.layout
    kv = [op.placement(k), op.placement(v)]
    if hk >= op.specs.world_size and all(isinstance(p, Shard) and p.dim == hd for p in kv):
        # k and v cut from their own weights (wk, wv): each rank's kv heads must be the
        # groups its query heads read, i.e. k repeated hq // hk times lines up with q
        repeated = [merge_layout(p.layout, hq // hk) for p in kv]
        target = op.unify([(q, pq.layout)] + list(zip((k, v), repeated)))
        if all(op.specs.same(target, r) for r in repeated):
            _require_heads(op, [(q, pq.dim)] + per_head, target)
            return target
    # each rank slices the kv heads its query heads read (several ranks may read the same)
    group = replace(target, size=hk, scale=target.scale * (hq // hk), rep=1, cover=True)
    for p in kv:  # kv heads that cannot follow the query heads' cut are computed whole
        if isinstance(p, Shard) and not (p.dim == hd and op.specs.same(p.layout, group)):
            op.reject(p.layout.root, f"{hk} kv heads cannot be cut like {hq} query heads over "
                                     f"{op.specs.world_size} ranks: each rank reads whole kv heads")
    op.require(k, Shard(hd, group))
    op.require(v, Shard(hd, group))
    _require_heads(op, [(q, pq.dim)] + per_head, target)
    return target


def _require_heads(op, operands: list[tuple[fx.Node, int]], layout: Layout) -> None:
    """Each (tensor, heads dim) of ``operands`` on the heads ``layout`` gives each rank."""
    for x, dim in operands:
        op.require(x, Shard(dim, layout))
