"""Shape ops: views, transposes, permutes, squeezes, slices and selects move a shard (each op's
``maps``, from :mod:`.dim_maps`, says where), splits and unbinds hand it to their pieces,
``cat`` and export's metadata checks."""

from __future__ import annotations

import operator

import torch
from torch import fx

from tpcompile.core.placement import Layout, Partial, Replicate, RootSpec, Shard
from tpcompile.passes.planner.dims import norm_dim, shape, sub_layout, val
from tpcompile.passes.planner.mutations import written_args
from tpcompile.passes.planner.rules.dim_maps import (
    DIM_MAPS, SQUEEZES, VIEWS, slice_bounds, slice_step,
)
from tpcompile.passes.planner.rules.einsum import einsum_rule
from tpcompile.passes.planner.rules.table import register
from tpcompile.passes.planner.rules.writes import any_placement

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


def _dim_op(op):
    """Ops that move, add, drop or regroup dims without mixing sharded data across them."""
    x = op.node.args[0]
    other = _passthrough_non_shard(op, x)
    if other is not None:
        return other
    mapped = DIM_MAPS[op.node.target](op.node, _shard_of(op, x))
    chunk = op.node.target is aten.slice.Tensor and mapped is not None \
        and mapped.layout != op.placement(x).layout
    # a slice of a tensor written in place (``h[..., :2] = 0``) is gathered as before, so the
    # write's own reason keeps its chain replicated
    written = chunk and any(v in written_args(u) for v in x.users for u in v.users)
    empty = chunk and mapped.layout.size == 0  # ``x[..., rd:]`` with rd the whole dim: nothing
    small = (chunk and not empty and mapped.layout.size < op.specs.world_size
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
    if chunk and not empty:
        op.require_block(mapped.layout)  # uneven fused chunks (Phi-3's qkv[..., :q_size])
    return mapped


def _localize_unflatten(node, local):
    """The shard lands on one of the unflattened sizes (the first, or a picked-apart chunk
    index's next: ``_unflattened``): that size is the rank's; shards of other dims change none."""
    if local.input_sharded_on(node, node.args[1]):
        sizes = list(node.args[2])
        (p,) = local.out_placements(node)
        sizes[p.dim - norm_dim(node.args[1], len(shape(node.args[0])))] = local.local_size(p)
        local.set_arg(node, 2, sizes)


def _localize_interleave(node, local):
    """The repeated dim is the rank's: so is the ``output_size`` the caller promised for it."""
    if (node.kwargs.get("output_size") is not None and len(node.args) > 2
            and local.input_sharded_on(node, node.args[2])):
        (p,) = local.out_placements(node)
        node.kwargs = {**node.kwargs, "output_size": local.local_size(p)}


def _localize_squeeze(node, local):
    """A rank's shard can be 1 long (5 rows over 3 ranks: 2, 2, 1): squeeze only the dims that
    are 1 long in the whole tensor."""
    if not isinstance(local.consumed(node.args[0], node), Shard):
        return
    x = node.args[0]
    n = len(shape(x))
    asked = node.args[1] if len(node.args) > 1 else range(n)
    asked = [norm_dim(d, n) for d in (asked if isinstance(asked, (list, tuple, range)) else [asked])]
    dims = [d for d in asked if isinstance(shape(x)[d], int) and shape(x)[d] == 1]
    local.replace_target(node, aten.squeeze.dims, (x, dims))


def _localize_slice(node, local):
    """A whole-dim slice keeps the rank's shard; a chunk's bounds become the rank's part of it
    (a strided one over the whole dim runs as it is: ``[s::k]`` of each rank's block)."""
    if slice_step(node) != 1 or not local.input_sharded_on(
            node, node.args[1] if len(node.args) > 1 else 0):
        return
    p, (out,) = local.consumed(node.args[0], node), local.out_placements(node)
    start, _ = slice_bounds(node, p.layout.size)
    node.args = tuple(node.args) + (0, None, None)[len(node.args) - 1:]
    before = local.local_size(Shard(p.dim, sub_layout(p.layout, 0, start))) if start else 0
    local.set_arg(node, 2, before)
    local.set_arg(node, 3, before + local.local_size(out))


# the shape constants a shard changes, per op (transposes, permutes, selects change none)
_LOCALIZE = {
    **dict.fromkeys(VIEWS + (aten.expand.default,), _local_shape_arg(1)),
    aten.unflatten.int: _localize_unflatten, aten.repeat_interleave.self_int: _localize_interleave,
    **dict.fromkeys(SQUEEZES, _localize_squeeze), aten.slice.Tensor: _localize_slice,
}
for _target, _map in DIM_MAPS.items():  # one propagation; a map and a localization per op
    register(_target, maps=_map, localize=_LOCALIZE.get(_target))(_dim_op)


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
          localize=lambda node, local: _localize_split(node, local), splits=True)
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
    """``cat(tensors, dim)``: operands cut along ``dim`` itself are read whole (joining shards
    along their own cut would interleave them), and only they: the others join as in any
    einsum-like op, and an operand read whole is then sliced to the output's shard on each
    rank (DeepSeek's MLA joins head-sharded ``k_nope`` with a ``k_pe`` every rank computes,
    expanded over the heads: each rank keeps its heads of it, at no cost). Pieces that each
    hold their part of one block of a cut (RoPE's ``cat((-x2, x1), -1)`` over a head_dim cut
    like its halves) join on each rank with no gather (:func:`_joined`); so do shards of
    different roots, into a root of their own (:func:`_laid_end_to_end`)."""
    tensors = [t for t in op.node.args[0] if isinstance(val(t), torch.Tensor)]
    n = len(shape(op.node))
    dim = norm_dim(op.node.args[1] if len(op.node.args) > 1 else 0, n)
    if any(isinstance(op.placement(t), Partial) for t in tensors) and all(
            isinstance(op.placement(t), Partial) or any_placement(t) for t in tensors):
        return Partial()  # partial sums padded with zeros (torchtitan's expert loop): a sum
    across = [t for t in tensors if isinstance(p := op.placement(t), Shard) and p.dim == dim]
    if across and (joined := _joined(op, tensors, dim)) is not None:
        return joined
    if len(across) == len(tensors) > 1 and (laid := _laid_end_to_end(op, tensors, dim)) is not None:
        return laid
    rest = [t for t in tensors if t not in across]
    operands = [(t, [d if d != dim else None for d in range(len(shape(t)))]) for t in rest]
    out = (einsum_rule(op, operands, [d if d != dim else "cat" for d in range(n)], linear="add")
           if rest else Replicate())
    if across and isinstance(out, Partial):  # partial sums joined with whole blocks: reduced
        for t in rest:
            op.require(t, Replicate())
        out = Replicate()
    for t in across:
        op.require(t, Shard(out.dim, out.layout) if isinstance(out, Shard) else Replicate())
    return out


def _joined(op, tensors: list, dim: int) -> Shard | None:
    """A cat along the sharded dim of pieces that, in any order, make up one block of a root
    (RoPE's ``cat((-x2, x1), -1)`` over a head_dim cut like its halves) runs on each rank's
    pieces when every rank holds, in each piece, the positions the block's cut gives it at
    that piece's place in the output: the output is that block (positions, not root indices,
    are what a shard holds). None where any rank's positions would move."""
    layouts = [p.layout if isinstance(p, Shard) and p.dim == dim else None
               for p in map(op.placement, tensors)]
    if any(lay is None or lay.rep != 1 or lay.copies != 1 or lay.tiles != 1 or lay.cover
           or (lay.root, lay.scale) != (layouts[0].root, layouts[0].scale) for lay in layouts):
        return None
    total = sum(lay.size for lay in layouts)
    block = Layout(layouts[0].root, total, min(lay.offset for lay in layouts), layouts[0].scale)
    spans = sorted(lay.covered() for lay in layouts if lay.size)
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (
            spans and (spans[0][0], spans[-1][1]) != block.covered()):
        return None  # not one block: overlapping pieces or a gap
    start = 0
    for lay in layouts:
        if op.specs.ranges(sub_layout(block, start, start + lay.size)) != op.specs.ranges(lay):
            return None
        start += lay.size
    return Shard(dim, block)


def _laid_end_to_end(op, tensors: list, dim: int) -> Shard | None:
    """A cat along the sharded dim of shards of different roots (Flux's ``cat([attn, mlp])``
    of heads and MLP features) runs on each rank's pieces, its output cut by a root of its
    own: the pieces' root ranges laid end to end (:meth:`RootSpec.joined`), a rank holding its
    part of each piece in turn, which a row-parallel consumer's weight rows follow. None (the
    pieces gathered) where a piece is not a plain range of its root cut in whole blocks, holds
    indices on several ranks (a sum over the joined dim would count them twice), or a demand
    names the joined root (its cut is its pieces', not one a demand can change)."""
    layouts = [op.placement(t).layout for t in tensors]
    # index i of a piece is root index offset + i: plain, or whole heads (scale == rep)
    if any(lay.rep != lay.scale or lay.copies != 1 or lay.tiles != 1 or lay.cover
           or lay.root.startswith("<")  # sequence or joined roots: gathered
           or op.specs.overlaps(lay) for lay in layouts):
        return None
    name = f"<{op.node.name}>"
    if any(d.root == name for d in op.constraints.demands):
        return None
    spec = op.specs.roots.get(name) or RootSpec.joined(
        name, op.specs.world_size, [(op.specs.roots[lay.root], *lay.covered()) for lay in layouts])
    if spec.size != sum(lay.size for lay in layouts):  # a piece of a part-head: no root range
        return None
    whole = Layout(name, spec.size)
    op.specs.roots[name] = spec
    start = 0
    for lay in layouts:
        if op.specs.ranges(sub_layout(whole, start, start + lay.size)) != op.specs.ranges(lay):
            return None  # a part's blocks clip through a unit: its ranks' ranges would move
        start += lay.size
    op.link(*(lay.root for lay in layouts))
    return Shard(dim, whole)


@register(aten._assert_tensor_metadata.default,
          localize=lambda node, local: _localize_metadata_check(node, local))
def _metadata_check(op):
    """Export's dtype/device checks: no output, no need to gather what they look at."""
    return None


def _localize_metadata_check(node, local):
    if isinstance(local.consumed(node.args[0], node), Shard):  # sizes are global: drop them
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "stride")}
