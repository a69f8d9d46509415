"""Shape ops: views, transposes, permutes, squeezes, slices and selects move a shard (their
``maps`` says where), splits and unbinds hand it to their pieces, ``cat`` and export's metadata
checks."""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from tpcompile.core.placement import Layout, Replicate, Shard
from tpcompile.passes.planner.dims import (
    chunk_layout, merge_layout, norm_dim, shape, size_expr, split_layout, sub_layout,
    tile_layout, untile_layout, val, view_groups,
)
from tpcompile.passes.planner.mutations import written_args
from tpcompile.passes.planner.rules.table import is_view, register
from tpcompile.passes.planner.rules.einsum import einsum_rule

aten = torch.ops.aten


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
        for p in local.out_placements(node):
            if not isinstance(p, Shard) or (isinstance(sizes[p.dim], int) and sizes[p.dim] == -1):
                continue
            if p.layout.tiles == 0:  # (batch * heads) with a symbolic batch: tiles of the shard
                sizes[p.dim] = _local_tiles(node, sizes[p.dim], p.layout, local.local_size(p))
            elif isinstance(sizes[p.dim], int):
                sizes[p.dim] = local.local_size(p)
        local.set_arg(node, index, sizes)
    return localize


def _local_tiles(node: fx.Node, size: fx.Node, layout: Layout, local_tile: int) -> fx.Node:
    """The rank's size of a dim of a symbolic number of tiles: ``size // tile * local_tile``,
    computed next to ``node`` from the global size the graph already holds."""
    if not isinstance(size, fx.Node):
        raise AssertionError(f"{node.name}: a symbolic count of tiles with a static size {size}")
    with node.graph.inserting_before(node):
        count = node.graph.call_function(operator.floordiv, (size, layout.tile_size))
        return node.graph.call_function(operator.mul, (count, local_tile))


def _map_view(node, p: Shard):
    """Where a reshape puts the sharded dim: kept, split (the shard goes to the leading part,
    or to the second when the leading part is a chunk index picked apart later: a fused qkv
    viewed as (3, heads, head_dim) and unbound), merged (whole dims in front of the shard make
    tiles: BART's (batch, heads) as batch * heads) or a tiled dim split back; None otherwise."""
    src, dst = shape(node.args[0]), shape(node)
    groups = view_groups(src, dst) or []
    if isinstance(src[p.dim], int) and src[p.dim] == 1:
        return _size_one_moved(groups, p)
    for gi, gj in groups:
        if p.dim not in gi:
            continue
        real_in = [d for d in gi if not (isinstance(src[d], int) and src[d] == 1)]
        real_out = [d for d in gj if not (isinstance(dst[d], int) and dst[d] == 1)]
        if not real_out:
            return None
        if len(real_in) == 1 and len(real_out) == 1:
            return Shard(real_out[0], p.layout)
        if p.layout.tiles != 1:
            return _untile(p, src, dst, real_in, real_out)
        if len(real_in) == 1 and all(isinstance(dst[d], int) for d in real_out[1:]):
            inner = math.prod(dst[d] for d in real_out[1:])
            lead = real_out[0]
            if len(real_out) > 1 and isinstance(dst[lead], int) and _picked_apart(node, lead):
                chunked = chunk_layout(p.layout, dst[lead], dst[real_out[1]],
                                       math.prod(dst[d] for d in real_out[2:]))
                if chunked is not None:
                    return Shard(real_out[1], chunked)
            return Shard(lead, split_layout(p.layout, dst[lead], inner))
        k = real_in.index(p.dim)
        if len(real_out) == 1 and all(isinstance(src[d], int) for d in real_in[k + 1:]):
            # whole dims in front may be symbolic (a dynamic batch): a symbolic count of tiles
            outer, inner = (math.prod(src[d] for d in part) for part in (real_in[:k], real_in[k + 1:]))
            return Shard(real_out[0], tile_layout(merge_layout(p.layout, inner), outer))
        return None
    return None


def _size_one_moved(groups, p: Shard):
    """A shard of a size-1 dim (a chunk of one unit, whole on every rank: MQA's key head
    viewed per head) goes to the output's size-1 dim at the same place among the size-1 dims
    between the same two sized dims; None when the view drops it."""
    ones, at = ([], []), None
    for gi, gj in groups + [([None], [None])]:
        if gi and gj:  # a sized group (or the end) closes the run of size-1 dims
            if at is not None:
                return Shard(ones[1][at], p.layout) if at < len(ones[1]) else None
            ones = ([], [])
        elif gi:
            at = len(ones[0]) if gi[0] == p.dim else at
            ones[0].append(gi[0])
        else:
            ones[1].append(gj[0])
    return None


def _size_one_squeezed(node, p: Shard):
    """``unsqueeze`` / ``squeeze`` of a tensor sharded on a size-1 dim: moved by the dims
    inserted or dropped before it; None when it is the dim squeezed."""
    n_in, d = len(shape(node.args[0])), p.dim
    if node.target is aten.unsqueeze.default:
        return Shard(d + (norm_dim(node.args[1], n_in + 1) <= d), p.layout)
    if node.target is aten.squeeze.default:
        return None
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    dims = [norm_dim(x, n_in) for x in dims]
    squeezed = [x for x in dims if x < d and isinstance(shape(node.args[0])[x], int)
                and shape(node.args[0])[x] == 1]  # squeeze leaves dims longer than 1 alone
    return None if d in dims else Shard(d - len(squeezed), p.layout)


def _untile(p: Shard, src, dst, real_in, real_out):
    """A tiled dim (and whole dims after it) viewed as (tiles..., sharded [* inner]): the
    shard lands on the last output dim, merged with the inner dims (``(B * T * H, d)`` back
    to ``(B, T, H * d)``); None for any other regrouping."""
    if real_in[0] != p.dim or len(real_out) < 2 or not all(isinstance(src[d], int) for d in real_in[1:]):
        return None
    inner = math.prod(src[d] for d in real_in[1:])
    outer = [size_expr(dst[d]) for d in real_out[:-1]]
    if size_expr(dst[real_out[-1]]) != p.layout.tile_size * inner or (
            p.layout.tiles and not (all(isinstance(o, int) for o in outer)
                                    and math.prod(outer) == p.layout.tiles)):
        return None
    return Shard(real_out[-1], merge_layout(untile_layout(p.layout), inner))


def _picked_apart(node: fx.Node, dim: int, depth: int = 4) -> bool:
    """Whether dim ``dim`` of ``node`` is taken apart index by index (unbind, select) by its
    users, following it through ops that only move dims."""
    n, size = len(shape(node)), size_expr(shape(node)[dim])
    for user in node.users:
        if user.args[0] is not node:
            continue
        if user.target in (aten.unbind.int, aten.select.int):
            if norm_dim(user.args[1] if len(user.args) > 1 else 0, n) == dim:
                return True
        elif depth and is_view(user) and isinstance(size, int):  # int(): no guard on a symbol
            moved = _maps(user, Shard(dim, Layout("", size)))
            if moved is not None and _picked_apart(user, moved.dim, depth - 1):
                return True
    return False


VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


@register(*VIEWS, aten.transpose.int, aten.t.default, aten.permute.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
          aten.expand.default, aten.slice.Tensor, aten.select.int, aten.repeat.default,
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
    # a slice of a tensor written in place (``h[..., :2] = 0``) is gathered as before, so the
    # write's own reason keeps its region replicated
    written = chunk and any(v in written_args(u) for v in x.users for u in v.users)
    small = (chunk and mapped.layout.size < op.specs.world_size
             and (written or not op.specs.is_full(mapped.layout)))
    if small and not written and op.param_behind(x) is None and op.is_chunk(mapped.layout):
        # a chunk of a fused projection too small to split over the ranks (Falcon's one key
        # head, ``qkv[..., -2:-1, :]``): computed whole on every rank, like MQA's k / v
        op.require_whole(f"{op.node.name} takes {mapped.layout.size} of {x.name}'s "
                         f"{op.specs.roots[mapped.layout.root].size} units, fewer than the ranks",
                         mapped.layout)
    if mapped is None or small:
        # a smaller chunk of anything else would be a replicated block of the root, which no
        # row-parallel consumer can read: gather before it instead
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
            # new leading dims and broadcast size-1 dims do not move the sharded dim; a sharded
            # size-1 dim (one unit, whole on every rank) broadcast to more is no shard of it
            moved = d + n_out - n_in
            kept = d in src or (isinstance(dst_shape[moved], int) and dst_shape[moved] == 1)
            return Shard(moved, p.layout) if kept else None
        if d not in src:  # a size-1 dim whole on every rank: unsqueeze moves it, squeeze drops it
            return _size_one_squeezed(node, p)
        dst = [i for i, s in enumerate(dst_shape) if not (isinstance(s, int) and s == 1)]
        return Shard(dst[src.index(d)], p.layout)
    if t is aten.slice.Tensor:
        if norm_dim(args[1] if len(args) > 1 else 0, n_in) != d:
            return p
        if _slice_step(node) != 1:
            return _strided(node, p)
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
    if t is aten.repeat.default:
        # repeats align with the trailing dims (extra ones add leading dims); repeating the
        # sharded dim r times is r tiles of it, each rank's tile its own indices
        lead = len(args[1]) - n_in
        r = args[1][lead + d]
        if not isinstance(r, int):
            return None
        return Shard(d + lead, p.layout if r == 1 else tile_layout(p.layout, r))
    if p.layout.tiles != 1 and t in (aten.repeat_interleave.self_int, aten.unflatten.int,
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


def _slice_step(node: fx.Node):
    return node.args[4] if len(node.args) > 4 else 1


def _strided(node: fx.Node, p: Shard):
    """Every k-th index of the whole sharded dim from offset ``s < k`` (gpt-oss's interleaved
    ``gate_up[..., ::2]`` and ``[..., 1::2]``): the dim viewed as (size / k, k), index ``s`` of
    the inner part, so the shard is that view's leading dim; each rank's block must start at a
    multiple of k (``check_aligned``), where its local slice ``[s::k]`` starts too."""
    args, size, step = node.args, p.layout.size, _slice_step(node)
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    if not all(isinstance(v, int) or v is None for v in (start, end, step)) or \
            p.layout.copies != 1 or p.layout.tiles != 1 or size % step:
        return None
    s, e, _ = slice(start, end, step).indices(size)
    if s >= step or len(range(s, e, step)) != size // step:
        return None
    return Shard(p.dim, split_layout(p.layout, size // step, step))


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
    elif (node.target is aten.repeat_interleave.self_int and node.kwargs.get("output_size") is not None
          and len(node.args) > 2 and local.input_sharded_on(node, node.args[2])):
        # the repeated dim is the rank's: so is the size the caller promised for it
        (p,) = local.out_placements(node)
        node.kwargs = {**node.kwargs, "output_size": local.local_size(p)}
    elif node.target in SQUEEZES and isinstance(local.consumed(node.args[0], node), Shard):
        # a rank's shard can be 1 long (5 rows over 3 ranks: 2, 2, 1): squeeze only the dims
        # that are 1 long in the whole tensor
        x = node.args[0]
        n = len(shape(x))
        asked = node.args[1] if len(node.args) > 1 else range(n)
        asked = [norm_dim(d, n) for d in (asked if isinstance(asked, (list, tuple, range)) else [asked])]
        dims = [d for d in asked if isinstance(shape(x)[d], int) and shape(x)[d] == 1]
        local.replace_target(node, aten.squeeze.dims, (x, dims))
    elif node.target is aten.slice.Tensor and _slice_step(node) == 1 and local.input_sharded_on(
            node, node.args[1] if len(node.args) > 1 else 0):
        # a whole-dim slice keeps the rank's shard; a chunk's bounds become the rank's part of it
        # (a strided one over the whole dim runs as it is: [s::k] of each rank's block)
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
    if p.layout.tiles != 1:  # chunks of a tiled dim cut across tiles: gathered
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
