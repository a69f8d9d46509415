"""Shard geometry: which rank owns each global index, and where pieces sit in a local shard."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tpcompile.core.placement import Demand, Layout, RootSpec, Specs
from tpcompile.core.shards import Piece, owned_ranges, pieces

# fused qkv with 8 query heads and 2 KV heads (head_dim 8) at 4 ranks: q sharded, k/v replicated
FUSED_GQA_WS4 = (((0, 16), (64, 96)), ((16, 32), (64, 96)), ((32, 48), (64, 96)), ((48, 96),))


def test_overlapping_blocks_are_owned_by_the_lowest_rank():
    assert owned_ranges(FUSED_GQA_WS4) == (((0, 16), (64, 96)), ((16, 32),), ((32, 48),), ((48, 64),))


def test_pieces_cut_at_ownership_and_know_their_local_position():
    assert pieces(FUSED_GQA_WS4, 3) == (Piece(48, 64, 0, True), Piece(64, 96, 16, False))
    assert pieces(FUSED_GQA_WS4, 1) == (Piece(16, 32, 0, True), Piece(64, 96, 16, False))
    assert pieces(FUSED_GQA_WS4, 0) == (Piece(0, 16, 0, True), Piece(64, 96, 16, True))


def test_uneven_disjoint_layout_is_all_owned():
    specs = Specs(3, {"w": RootSpec.build("w", 11008, 3, [])})
    ranges = specs.ranges(Layout("w", 11008))
    assert owned_ranges(ranges) == ranges


@st.composite
def layouts(draw):
    """Random roots cut into blocks (some replicated) over 1-6 ranks, as the planner makes them."""
    ws = draw(st.integers(1, 6))
    size = draw(st.integers(1, 64))
    cuts = sorted(set(draw(st.lists(st.integers(1, size), max_size=3))) - {size})
    demands = [Demand("w", s, e, replicate=draw(st.booleans()))
               for s, e in zip([0, *cuts], [*cuts, size])]
    specs = Specs(ws, {"w": RootSpec.build("w", size, ws, demands)})
    return specs.ranges(Layout("w", size)), size


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_index_is_owned_exactly_once_and_pieces_tile_the_shard(case):
    ranges, size = case
    owned = sorted(i for per_rank in owned_ranges(ranges) for s, e in per_rank for i in range(s, e))
    assert owned == list(range(size))
    for rank, held in enumerate(ranges):
        local_order = [i for s, e in held for i in range(s, e)]
        from_pieces = [None] * len(local_order)
        for p in pieces(ranges, rank):
            for k in range(p.size):
                from_pieces[p.local + k] = p.start + k
        assert from_pieces == local_order
