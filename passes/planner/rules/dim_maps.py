"""Where each shape op puts a shard of its input: one small map per op (``DIM_MAPS``).

A map ``(node, shard) -> Shard | None`` says which output dim carries the input's sharded dim,
with its layout (a reshape may split it into a chunk of a fused qkv, merge whole dims in front
of it into tiles, or a slice may take a block of it), or None when the op cuts the shard up
(a transpose never does; selecting the sharded dim always does). :mod:`.views` registers each
map as its op's rule ``maps``, so the planner can follow a parameter through the views that
reach a matmul and the shape ops' rule can place their output; the model is DTensor's
``dim_maps`` (``torch/distributed/tensor/_ops/_view_ops.py``), with layouts instead of mesh
placements.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import fx

from tpcompile.core.placement import Layout, Shard
from tpcompile.passes.planner.dims import (
    chunk_layout, example_size, merge_layout, norm_dim, shape, size_expr, split_layout,
    sub_layout, tile_layout, untile_layout, view_groups,
)
from tpcompile.passes.planner.rules.table import is_view, rule_for

aten = torch.ops.aten

__all__ = ["DIM_MAPS", "VIEWS", "SQUEEZES", "slice_step", "slice_bounds"]

VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


def _ndim(node: fx.Node) -> int:
    return len(shape(node.args[0]))


def _sized(s: tuple) -> list[int]:
    """The dims of shape ``s`` not known to be 1 long."""
    return [i for i, n in enumerate(s) if not (isinstance(n, int) and n == 1)]


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
        regrouped = _tiled_split(p, [src[d] for d in real_in], [dst[d] for d in real_out], k)
        if regrouped is not None:
            return Shard(real_out[0], regrouped)
        if len(real_out) == 1 and all(isinstance(src[d], int) for d in real_in[k + 1:]):
            # whole dims in front may be symbolic (a dynamic batch): a symbolic count of tiles
            outer, inner = (math.prod(src[d] for d in part) for part in (real_in[:k], real_in[k + 1:]))
            return Shard(real_out[0], tile_layout(merge_layout(p.layout, inner), outer))
        return None
    return None


def _tiled_split(p: Shard, src: list, dst: list, k: int):
    """(outer..., sharded) viewed as (outer * heads, inner...) with sharded = heads * inner:
    the sharded dim split into heads and merged with the whole dims in front, as
    ``nn.MultiheadAttention`` views (T, B, E) as (T, B * heads, head_dim). The first output dim
    holds ``outer`` tiles of the rank's heads; None for any other regrouping.

    Sizes are compared at the capture's example where symbols differ: cross-attention views
    the memory's keys with the *query's* batch (``k.view(S, bsz * heads, -1)``), a symbol of
    another input that export does not equate with the memory's; the view (and the attention
    after it) fails unless they are equal, and the rank's size is computed from the view's own
    size argument (``_local_tiles``)."""
    if k != len(src) - 1 or k == 0 or len(dst) < 2 or p.layout.tiles != 1 or not isinstance(
            src[k], int) or not all(isinstance(s, (int, torch.SymInt)) for s in dst):
        return None
    inner = math.prod(example_size(s) for s in dst[1:])
    outer = math.prod(size_expr(s) for s in src[:k])  # a dynamic batch: symbolic
    if src[k] % inner or example_size(dst[0]) != math.prod(
            example_size(s) for s in src[:k]) * (src[k] // inner):
        return None
    return tile_layout(split_layout(p.layout, src[k] // inner, inner),
                       int(outer) if all(isinstance(s, int) for s in src[:k]) else outer)


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


# ops that copy their input as it is: the dims of their output are the input's
_COPIES = (aten.clone.default, aten.contiguous.default)


def _picked_apart(node: fx.Node, dim: int, depth: int = 5) -> bool:
    """Whether dim ``dim`` of ``node`` is taken apart index by index (unbind, select) by its
    users, following it through ops that only move dims."""
    n, size = len(shape(node)), size_expr(shape(node)[dim])
    for user in node.users:
        if user.args[0] is not node:
            continue
        if user.target in (aten.unbind.int, aten.select.int):
            if norm_dim(user.args[1] if len(user.args) > 1 else 0, n) == dim:
                return True
        elif user.target in _COPIES and depth:  # ``.contiguous()`` before the selects
            if _picked_apart(user, dim, depth - 1):
                return True
        elif depth and is_view(user) and isinstance(size, int):  # int(): no guard on a symbol
            moved = rule_for(user).maps(user, Shard(dim, Layout("", size)))
            if moved is not None and _picked_apart(user, moved.dim, depth - 1):
                return True
    return False


def _transposed(node, p: Shard):
    n, args = _ndim(node), node.args
    if n < 2:  # t() of a vector is the vector
        return p
    a, b = (norm_dim(args[1], n), norm_dim(args[2], n)) if len(args) > 2 else (0, 1)
    return Shard(b if p.dim == a else a if p.dim == b else p.dim, p.layout)


def _permuted(node, p: Shard):
    return Shard([norm_dim(x, _ndim(node)) for x in node.args[1]].index(p.dim), p.layout)


def _reversed(node, p: Shard):
    """``numpy_T``: every dim reversed."""
    return Shard(_ndim(node) - 1 - p.dim, p.layout)


def _moved(node, p: Shard):
    n = _ndim(node)
    order = list(range(n))
    order.insert(norm_dim(node.args[2], n), order.pop(norm_dim(node.args[1], n)))
    return Shard(order.index(p.dim), p.layout)


def _sized_kept(node, p: Shard) -> Shard:
    """Dims longer than 1 keep their order: the sharded one is the k-th of them on both sides."""
    return Shard(_sized(shape(node))[_sized(shape(node.args[0])).index(p.dim)], p.layout)


def _unsqueezed(node, p: Shard):
    if p.dim in _sized(shape(node.args[0])):
        return _sized_kept(node, p)
    # a sharded size-1 dim (one unit, whole on every rank): moved by the dim inserted before it
    return Shard(p.dim + (norm_dim(node.args[1], _ndim(node) + 1) <= p.dim), p.layout)


def _squeezed(node, p: Shard):
    """``squeeze.dim`` / ``squeeze.dims``: a sharded size-1 dim moves by the size-1 dims
    dropped before it (squeeze leaves longer dims alone), and is dropped when asked for."""
    if p.dim in _sized(shape(node.args[0])):
        return _sized_kept(node, p)
    n, src = _ndim(node), shape(node.args[0])
    asked = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    asked = [norm_dim(x, n) for x in asked]
    dropped = [x for x in asked if x < p.dim and isinstance(src[x], int) and src[x] == 1]
    return None if p.dim in asked else Shard(p.dim - len(dropped), p.layout)


def _squeezed_all(node, p: Shard):
    """``squeeze()``: every size-1 dim goes, a sharded one with them."""
    return _sized_kept(node, p) if p.dim in _sized(shape(node.args[0])) else None


def _expanded(node, p: Shard):
    """New leading dims and broadcast size-1 dims do not move the sharded dim; a sharded
    size-1 dim (one unit, whole on every rank) broadcast to more is no shard of it."""
    moved = p.dim + len(shape(node)) - _ndim(node)
    out = shape(node)[moved]
    kept = p.dim in _sized(shape(node.args[0])) or (isinstance(out, int) and out == 1)
    return Shard(moved, p.layout) if kept else None


def _sliced(node, p: Shard):
    args = node.args
    if norm_dim(args[1] if len(args) > 1 else 0, _ndim(node)) != p.dim:
        return p
    if slice_step(node) != 1:
        return _strided(node, p)
    bounds = slice_bounds(node, p.layout.size)
    if bounds is None:
        return None
    if bounds == (0, p.layout.size):
        return p
    return Shard(p.dim, sub_layout(p.layout, *bounds)) if (
        p.layout.copies == 1 and p.layout.tiles == 1) else None


def _selected(node, p: Shard):
    dim = norm_dim(node.args[1], _ndim(node))
    return None if dim == p.dim else Shard(p.dim - (dim < p.dim), p.layout)


def _repeated(node, p: Shard):
    """Repeats align with the trailing dims (extra ones add leading dims); repeating the
    sharded dim r times is r tiles of it, each rank's tile its own indices."""
    lead = len(node.args[1]) - _ndim(node)
    r = node.args[1][lead + p.dim]
    if not isinstance(r, int):
        return None
    return Shard(p.dim + lead, p.layout if r == 1 else tile_layout(p.layout, r))


def _untiled(regroup):
    """The maps below regroup the sharded dim assuming no tiles: a tiled shard is cut up."""
    @functools.wraps(regroup)
    def maps(node, p: Shard):
        return regroup(node, p) if p.layout.tiles == 1 else None
    return maps


@_untiled
def _interleaved(node, p: Shard):
    """``repeat_interleave`` of the sharded dim: each index repeated, the shard's units too."""
    args = node.args
    dim = norm_dim(args[2], _ndim(node)) if len(args) > 2 else None
    if dim != p.dim or not isinstance(args[1], int):
        return p if dim is not None and dim != p.dim else None
    return Shard(p.dim, merge_layout(p.layout, args[1]))


@_untiled
def _unflattened(node, p: Shard):
    """The shard goes to the leading size, or to the second when the leading one is a chunk
    index picked apart later (``nn.MultiheadAttention``'s packed in_proj unflattened to
    (3, embed_dim) and selected: each rank holds its heads of q, k and v), as in ``_map_view``."""
    dim, count = norm_dim(node.args[1], _ndim(node)), len(node.args[2])
    if dim != p.dim:
        return Shard(p.dim + (count - 1) * (p.dim > dim), p.layout)
    sizes = list(shape(node)[dim:dim + count])  # a -1 among the sizes resolved
    if any(not isinstance(s, int) for s in sizes[1:]):
        return None
    inner = math.prod(sizes[1:])
    if len(sizes) > 1 and isinstance(sizes[0], int) and _picked_apart(node, dim):
        chunked = chunk_layout(p.layout, sizes[0], sizes[1], math.prod(sizes[2:]))
        if chunked is not None:
            return Shard(dim + 1, chunked)
    return Shard(p.dim, split_layout(p.layout, p.layout.size // inner, inner))


@_untiled
def _flattened(node, p: Shard):
    """``flatten(start_dim=0, end_dim=-1)``: the shard leads the merged dims or moves left."""
    args, n, d = node.args, _ndim(node), p.dim
    a = norm_dim(args[1] if len(args) > 1 else 0, n)
    b = norm_dim(args[2] if len(args) > 2 else -1, n)
    if d < a or d > b:
        return Shard(d - (b - a) * (d > b), p.layout)
    merged = shape(node.args[0])[a + 1:b + 1]
    if d != a or any(not isinstance(s, int) for s in merged):
        return None
    return Shard(a, merge_layout(p.layout, math.prod(merged)))


def slice_step(node: fx.Node):
    return node.args[4] if len(node.args) > 4 else 1


def _strided(node: fx.Node, p: Shard):
    """Every k-th index of the whole sharded dim from offset ``s < k`` (gpt-oss's interleaved
    ``gate_up[..., ::2]`` and ``[..., 1::2]``): the dim viewed as (size / k, k), index ``s`` of
    the inner part, so the shard is that view's leading dim; each rank's block must start at a
    multiple of k (``check_aligned``), where its local slice ``[s::k]`` starts too."""
    args, size, step = node.args, p.layout.size, slice_step(node)
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    if not all(isinstance(v, int) or v is None for v in (start, end, step)) or \
            p.layout.copies != 1 or p.layout.tiles != 1 or size % step:
        return None
    s, e, _ = slice(start, end, step).indices(size)
    if s >= step or len(range(s, e, step)) != size // step:
        return None
    return Shard(p.dim, split_layout(p.layout, size // step, step))


def slice_bounds(node: fx.Node, size: int) -> tuple[int, int] | None:
    """``[start, stop)`` of a ``slice`` with step 1 and static bounds, clamped as Python does."""
    args = node.args
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    if step != 1 or not all(b is None or isinstance(b, int) for b in (start, end)):
        return None
    start, end = slice(start, end).indices(size)[:2]
    return start, max(start, end)


def _same(node: fx.Node, p: Shard):
    """``alias``: the same dims of the same storage (export's ``self.k[:b]`` when ``b`` is the
    whole dim: a cache written through it is the buffer itself)."""
    return p


DIM_MAPS = {
    **dict.fromkeys(VIEWS, _map_view), aten.alias.default: _same,
    aten.transpose.int: _transposed, aten.t.default: _transposed,
    aten.permute.default: _permuted, aten.numpy_T.default: _reversed, aten.movedim.int: _moved,
    aten.unsqueeze.default: _unsqueezed, aten.squeeze.dim: _squeezed,
    aten.squeeze.dims: _squeezed, aten.squeeze.default: _squeezed_all,
    aten.expand.default: _expanded, aten.slice.Tensor: _sliced, aten.select.int: _selected,
    aten.repeat.default: _repeated, aten.repeat_interleave.self_int: _interleaved,
    aten.unflatten.int: _unflattened, aten.flatten.using_ints: _flattened,
}
