"""Insert the plan's conversions and gradient syncs into one rank's graph.

* Each conversion ``(value, user) -> placement`` becomes the ops that produce it: an all-reduce
  (Partial -> Replicate, Megatron *g*; by max or min for a partial extremum, through which no
  gradient flows), an all-gather (Shard -> Replicate), local slices
  (Replicate -> Shard: no communication), or ``zero_summand`` (Replicate -> Partial, a carried
  sum's replicated operand: the value on rank 0, zeros elsewhere, its gradient whole). Users
  that need the same value in the same placement share one conversion, so a value feeding q,
  k and v is converted once.
* Each replicated value whose gradient arrives as per-rank partial sums gets one
  ``copy_into_chain`` (Megatron *f*) in front of the consumers that make it partial; weights
  with replicated blocks get ``sync_grad_pieces`` on those blocks, one per repeated block.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from tpcompile.runtime import collectives as C
from tpcompile.runtime.backward_reach import backward_nodes
from tpcompile.core.placement import Partial, Replicate, Shard, Specs, positions
from tpcompile.core.shards import gather_args
from tpcompile.core.block_paths import block_of, repeated_block_paths
from tpcompile.core.plan import ShardingPlan
from tpcompile.passes.planner.dims import untile_layout

aten = torch.ops.aten
_SIZES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)  # a size read's value

__all__ = ["insert_collectives_pass"]


def _slices(g: fx.Graph, x: fx.Node, dim: int, pieces: list[tuple[int, int]], full: int):
    """This rank's pieces of a local tensor, as a fresh tensor: a view would keep the whole
    (replicated) tensor alive wherever the shard is saved for backward."""
    if pieces == [(0, full)]:
        return x
    parts = [g.call_function(aten.slice.Tensor, (x, dim, s, e)) for s, e in pieces]
    if len(parts) > 1:
        return g.call_function(aten.cat.default, (parts, dim))
    return g.call_function(aten.clone.default, (parts[0],))


class _Converter:
    def __init__(self, gm: fx.GraphModule, plan: ShardingPlan, rank: int, group: str):
        self.g, self.plan, self.rank, self.group = gm.graph, plan, rank, group
        self.specs = plan.specs

    def local_held(self, placement, full: int):
        if isinstance(placement, Shard):
            return self.specs.ranges(placement.layout)[self.rank]
        return ((0, full),)

    def convert(self, x: fx.Node, src, dst, sum_grads: bool = False) -> fx.Node:
        g, ws = self.g, self.plan.world_size
        if _symbolic_tiles(src) or _symbolic_tiles(dst):
            return self._convert_tiles(x, src, dst, sum_grads)
        if isinstance(src, Partial) and src.reduce != "sum":  # each rank's max (min) candidate
            x = g.call_function(C.plain_all_reduce, (x, self.group, src.reduce))
            if dst == Replicate():
                return x
            src = Replicate()
        if isinstance(src, Partial) and isinstance(dst, Shard):
            width, index, mine, _ = gather_args(self.specs, dst.layout, self.rank, ws)
            return g.call_function(C.reduce_scatter, (x, dst.dim, width, index, mine, ws, self.group))
        if isinstance(dst, Partial):  # a carried sum's replicated operand: rank 0's share
            assert isinstance(src, Replicate), (src, dst)
            return g.call_function(C.zero_summand, (x, self.rank == 0))
        if isinstance(src, Partial):
            x = g.call_function(C.all_reduce, (x, self.group))
            return g.call_function(C.copy_into_chain, (x, self.group)) if sum_grads else x
        if isinstance(dst, Replicate):
            if isinstance(src, Shard):
                args = gather_args(self.specs, src.layout, self.rank, ws)
                gather = C.gather_into_chain if sum_grads else C.all_gather
                x = g.call_function(gather, (x, src.dim) + args + (ws, self.group))
            return x
        assert isinstance(dst, Shard), dst
        if isinstance(src, Shard) and self.specs.is_full(src.layout):
            # whole on every rank (a block too small to split): sliced, each rank's gradient
            # its part, as the block's gradient sync expects
            src = Replicate()
        elif isinstance(src, Shard) and (src.dim != dst.dim or not self.specs.contains(src.layout, dst.layout)):
            x = self.convert(x, src, Replicate(), sum_grads)  # re-shard: gathered, then sliced
            src = Replicate()
        held = self.local_held(src, dst.layout.size)
        wanted = self.specs.ranges(dst.layout)[self.rank]
        return _slices(g, x, dst.dim, positions(held, wanted), sum(e - s for s, e in held))

    def _convert_tiles(self, x: fx.Node, src, dst, sum_grads: bool) -> fx.Node:
        """A dim of a symbolic number of tiles (``batch * heads``, dynamic batch) converts tile
        by tile: viewed as (tiles, tile), its tile dim converts as any shard, then merges back."""
        if _symbolic_tiles(src):
            tile = untile_layout(src.layout)
            x = self._per_tile(x, src.dim, self.specs.local_size(tile, self.rank),
                               lambda t: self.convert(t, Shard(src.dim + 1, tile), Replicate(), sum_grads))
            src = Replicate()
        elif isinstance(src, Shard):  # another dim's shard: gathered first
            x, src = self.convert(x, src, Replicate(), sum_grads), Replicate()
        if not _symbolic_tiles(dst):
            return self.convert(x, src, dst, sum_grads)
        tile = untile_layout(dst.layout)
        return self._per_tile(x, dst.dim, tile.size,
                              lambda t: self.convert(t, src, Shard(dst.dim + 1, tile), sum_grads))

    def _per_tile(self, x: fx.Node, dim: int, tile_size: int, convert) -> fx.Node:
        """``convert`` applied to ``x`` with ``dim`` viewed as (tiles, ``tile_size``)."""
        x = self.g.call_function(aten.unflatten.int, (x, dim, [-1, tile_size]))
        return self.g.call_function(aten.flatten.using_ints, (convert(x), dim, dim + 1))


def _symbolic_tiles(p) -> bool:
    return isinstance(p, Shard) and p.layout.tiles == 0


def _grad_sync_buckets(gm, plan: ShardingPlan, nodes: dict, order: dict) -> list[list]:
    """The plan's gradient syncs of values, as [(value, partial users)] buckets, each one
    all-reduce. A value *waits* on another when it is computed from a reader of the other's
    synced copy (its gradient comes back through those readers); the values of one repeated
    block are bucketed by their height in that order, so a bucket's values wait on none of
    each other and the block pays the fewest all-reduces, the longest chain of waits (Mirsky;
    Megatron's bound counts the same): the q / k / v inputs of joint attention's two streams
    share one, then their MLP inputs, whichever order export wrote them in. A value made
    outside the blocks is bucketed with the block after it (Gemma 4's per-layer inputs, made
    before the layers and read by each: their gradient is whole by the time the first layer's
    input is synced). A model input no gradient is asked of (a diffusion model's text
    embeddings, fed to a column-parallel projection), or a value made from such inputs alone
    (an attention mask cast to the scores' dtype, read by the cut heads), is a bucket of its
    own, which never runs (:func:`~tpcompile.runtime.backward_reach.backward_nodes`): in a
    block's bucket it would keep out the values computed from its readers, and its bytes would
    ride in that block's all-reduce on every step. The
    readers that ran between one value and the next move after the last (they only depend on
    earlier nodes), so the bucket exists before its first reader."""
    blocks = repeated_block_paths(gm)
    position = _positions([nodes[v] for v in plan.grad_syncs], blocks, order)
    synced = sorted(((nodes[v], [nodes[u] for u in us]) for v, us in plan.grad_syncs.items()),
                    key=lambda item: position[item[0]])
    keys = _bucket_keys(synced, blocks, order)
    buckets, groups, earlier, reached = [], {}, {}, backward_nodes(gm)
    for value, users in synced:
        if value not in reached:
            buckets.append([(value, users)])
            continue
        before = earlier.setdefault(keys[value], [])
        first = min((order[r] for _, readers, _ in before for r in readers), default=order[value])
        made = _made_from(value, first, order)
        height = 1 + max((h for _, readers, h in before if made & readers), default=0)
        before.append((value, set(users), height))
        groups.setdefault((keys[value], height), []).append((value, users))
    buckets = sorted([*buckets, *groups.values()], key=lambda b: position[b[0][0]])
    for bucket in buckets:
        _sizes_at_the_value(bucket)
        _readers_after(bucket, order)
    return buckets


def _bucket_keys(synced: list, blocks, order: dict) -> dict:
    """Each synced value's block (``synced``: (value, readers) in position order): its own, or,
    where every reader it is synced for sits in other blocks, the first reader's (its gradient
    is whole once that block's backward has run: a text stream's output read by each image
    block's cross-attention joins the first image block's bucket). A value outside the blocks
    takes the block of the next value in one."""
    keys, following = {}, None
    for v, users in reversed(synced):
        own, readers = block_of(v, blocks), {block_of(u, blocks) for u in users}
        if own is not None and readers and own not in readers and None not in readers:
            own = block_of(min(users, key=order.__getitem__), blocks)
        following = own or following
        keys[v] = following
    return keys


def _made_from(value: fx.Node, first: int, order: dict) -> set[fx.Node]:
    """The nodes ``value``'s data is computed from, walked back to graph position ``first``
    (the earliest reader it could be computed from). A size read is not walked: no gradient
    comes back through it (:func:`_sizes_at_the_value` moves it off the reader)."""
    todo, seen = list(value.all_input_nodes), set()
    while todo:
        n = todo.pop()
        if n not in seen and not isinstance(n.meta.get("val"), _SIZES):
            seen.add(n)
            if order[n] > first:
                todo += n.all_input_nodes
    return seen


def _sizes_at_the_value(bucket: list) -> None:
    """A size read off a synced value's linear reader, of a dim the linear keeps (every dim
    but the last), reads the value itself: the same size, and no longer after the reader,
    which the bucket moves after its last value. torchtitan's rotary slices its table by
    ``q.size(1)``, read once, in the first block, off the q projection that its kv latent's
    rope piece (synced in q's bucket) is then made after."""
    for value, users in bucket:
        rank = len(getattr(value.meta.get("val"), "shape", ()))
        for u in users:
            if u.target is not aten.linear.default or u.args[0] is not value:
                continue
            for s in list(u.users):
                if s.target is aten.sym_size.int and 0 <= s.args[1] < rank - 1:
                    s.replace_input_with(u, value)


def _positions(synced: list, blocks, order: dict) -> dict:
    """Where each synced value sorts: a weight (a ``get_attr``, read by nothing its block
    computes before) at the head of its block's values, so its gradient joins the block's
    first bucket (a LoRA B factor on a row-parallel linear, whose gradient is partial) instead
    of sitting where export put the weights, before every block: one all-reduce fewer each."""
    heads: dict = {}
    for v in synced:
        if v.op != "get_attr":
            key = block_of(v, blocks)
            heads[key] = min(heads.get(key, order[v]), order[v])
    heads.pop(None, None)  # outside the blocks, a weight sorts where it is
    out = {}
    for v in synced:
        key = block_of(v, blocks) if v.op == "get_attr" else None
        out[v] = heads[key] - 0.5 if key in heads else order[v]
    return out


def _early_readers(bucket: list, anchor: fx.Node, order: dict) -> list[fx.Node]:
    """The nodes before ``anchor`` that read a bucketed value, and everything they feed there."""
    seen, todo = set(), [u for _, us in bucket for u in us if order[u] < order[anchor]]
    while todo:
        n = todo.pop()
        if n not in seen and order[n] < order[anchor]:
            seen.add(n)
            todo += list(n.users)
    return sorted(seen, key=order.__getitem__)


def _readers_after(bucket: list, order: dict) -> None:
    anchor = max((v for v, _ in bucket), key=order.__getitem__)
    early = _early_readers(bucket, anchor, order)
    if not early:
        return
    for n in reversed(early):
        anchor.append(n)  # keeps their relative order
    for i, n in enumerate(anchor.graph.nodes):
        order[n] = i


def _sync_grad_pieces(gm, plan: ShardingPlan, specs: Specs, rank: int, group: str, order) -> None:
    """One ``sync_grad_pieces`` per repeated block for the weights with replicated blocks in it
    (wk and wv where kv heads are fewer than ranks), and one for those outside blocks: one
    gradient all-reduce, not one each. Per block, so FSDP2 per block sees its gradients whole."""
    g, blocks = gm.graph, repeated_block_paths(gm)
    attrs = {n.target: n for n in g.nodes if n.op == "get_attr"}
    buckets: dict[str, list] = {}
    for p in plan.params.values():
        if p.grad_sync and isinstance(p.placement, Shard):
            block = next((b for b in blocks if p.name.startswith(b + ".")), "")
            buckets.setdefault(block, []).append(p)
    for params in buckets.values():
        weights = [attrs[p.name] for p in params]
        users = [list(w.users) for w in weights]
        with g.inserting_before(min((u for us in users for u in us), key=order.__getitem__)):
            synced = g.call_function(C.sync_grad_pieces, (
                weights, [p.placement.dim for p in params],
                [_replicated_pieces(specs, p.placement.layout, rank) for p in params], group))
            for i, (w, us) in enumerate(zip(weights, users)):
                item = g.call_function(operator.getitem, (synced, i))
                for u in us:
                    u.replace_input_with(w, item)


def _key(p):
    return ("S", p.dim, p.layout) if isinstance(p, Shard) else str(p)


def _replicated_pieces(specs: Specs, layout, rank: int) -> list[tuple[int, int]]:
    """Local positions of the indices every rank holds (their gradients are partial sums)."""
    ranges = specs.ranges(layout)

    def everywhere(i):
        return all(any(s <= i < e for s, e in r) for r in ranges)

    pieces, pos = [], 0
    for s, e in ranges[rank]:
        for i in range(s, e):
            if everywhere(i):
                if pieces and pieces[-1][1] == pos:
                    pieces[-1] = (pieces[-1][0], pos + 1)
                else:
                    pieces.append((pos, pos + 1))
            pos += 1
    return pieces


def _insert_grad_syncs(gm: fx.GraphModule, plan: ShardingPlan, nodes: dict, order: dict,
                       group: str) -> dict[str, fx.Node]:
    """One ``copy_into_chain`` (*f*) per bucket of gradient-synced values, read by the users
    the plan lists; returns value name -> its synced copy."""
    g = gm.graph
    f_of = {}
    for bucket in _grad_sync_buckets(gm, plan, nodes, order):
        with g.inserting_before(min((u for _, us in bucket for u in us), key=order.__getitem__)):
            if len(bucket) == 1:
                synced = [g.call_function(C.copy_into_chain, (bucket[0][0], group))]
            else:
                call = g.call_function(C.copy_all_into_chain, ([v for v, _ in bucket], group))
                synced = [g.call_function(operator.getitem, (call, i)) for i in range(len(bucket))]
        for (value, users), f in zip(bucket, synced):
            f_of[value.name] = f
            for u in users:
                u.replace_input_with(value, f)
    return f_of


def _insert_conversions(g: fx.Graph, plan: ShardingPlan, nodes: dict, order: dict,
                        conv: _Converter, f_of: dict[str, fx.Node]) -> None:
    """Each conversion of the plan, once for all users that read the same value (or its synced
    copy) in the same placement."""
    groups: dict = {}
    for c in plan.conversions:
        user, f = nodes[c.user], f_of.get(c.value)
        source = f if f is not None and f in user.all_input_nodes else nodes[c.value]
        groups.setdefault((source, _key(c.dst), c.sum_grads), []).append((c, user))
    for (source, _, sum_grads), items in groups.items():
        c = items[0][0]
        with g.inserting_before(min((u for _, u in items), key=order.__getitem__)):
            out = conv.convert(source, c.src, c.dst, sum_grads)
        for _, user in items:
            user.replace_input_with(source, out)


def insert_collectives_pass(gm: fx.GraphModule, plan: ShardingPlan, rank: int, group: str):
    """The plan's collectives: gradient syncs (*f*), then all-reduces (*g*), gathers,
    reduce-scatters and local slices where a consumer reads a value converted."""
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    conv = _Converter(gm, plan, rank, group)
    f_of = _insert_grad_syncs(gm, plan, nodes, order, group)
    _sync_grad_pieces(gm, plan, conv.specs, rank, group, order)
    _insert_conversions(gm.graph, plan, nodes, order, conv, f_of)
    gm.graph.lint()
    return gm
