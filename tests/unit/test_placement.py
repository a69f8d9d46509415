"""Layouts: exact per-rank ranges for even, uneven, head-aligned, blockwise and grouped shards."""

from __future__ import annotations

import pytest

from tpcompile.core.placement import Demand, Layout, Misaligned, RootSpec, Specs, positions


def specs(size, ws, *demands, name="w"):
    return Specs(ws, {name: RootSpec.build(name, size, ws, list(demands))})


def test_even_split():
    s = specs(8, 2)
    assert s.ranges(Layout("w", 8)) == (((0, 4),), ((4, 8),))


def test_uneven_split_gives_first_ranks_one_more():
    s = specs(11008, 3)
    sizes = [s.local_size(Layout("w", 11008), r) for r in range(3)]
    assert sizes == [3670, 3669, 3669]


def test_head_units_keep_heads_whole():
    # 6 heads of 8 over 4 ranks: 2, 2, 1, 1 heads
    s = specs(48, 4, Demand("w", 0, 48, 8))
    assert [s.local_size(Layout("w", 48), r) for r in range(4)] == [16, 16, 8, 8]
    heads = Layout("w", 6, scale=8)
    assert s.ranges(heads) == (((0, 2),), ((2, 4),), ((4, 5),), ((5, 6),))


def test_misaligned_view_demands_units():
    s = specs(48, 4)  # 12 each: cuts through heads of 8
    with pytest.raises(Misaligned) as e:
        s.ranges(Layout("w", 6, scale=8))
    (demand,) = e.value.demands
    assert demand == Demand("w", 0, 48, 8, reason=demand.reason)


def test_chunks_viewed_apart_demand_their_own_blocks_cut_alike():
    # a fused (3 x 2 heads of 4) qkv output viewed as (3, heads, head_dim): the heads dim holds
    # the same heads of q, k and v; contiguous 12 / 12 cuts give ranks different heads per chunk
    chunks = Layout("w", 2, scale=4, copies=3, period=8)
    with pytest.raises(Misaligned) as e:
        specs(24, 2).ranges(chunks)
    assert [(d.start, d.stop, d.unit) for d in e.value.demands] == [(0, 8, 4), (8, 16, 4), (16, 24, 4)]
    cut = specs(24, 2, *e.value.demands)
    assert cut.ranges(chunks) == (((0, 1),), ((1, 2),))
    assert cut.ranges(Layout("w", 24)) == (((0, 4), (8, 12), (16, 20)), ((4, 8), (12, 16), (20, 24)))


def test_fused_qkv_blocks_are_split_each():
    s = specs(24, 2, Demand("w", 0, 8), Demand("w", 8, 16), Demand("w", 16, 24))
    assert s.ranges(Layout("w", 24)) == (((0, 4), (8, 12), (16, 20)), ((4, 8), (12, 16), (20, 24)))
    assert s.ranges(Layout("w", 8, offset=8)) == (((0, 4),), ((4, 8),))


def test_blocks_with_fewer_units_than_ranks_are_replicated():
    s = specs(16, 4, Demand("w", 0, 16, 8))  # 2 kv heads, 4 ranks
    assert s.is_full(Layout("w", 16))
    assert s.overlaps(Layout("w", 16))


def test_grouped_heads_repeat_their_kv_head():
    s = specs(16, 2, Demand("w", 0, 16, 8))  # 2 kv heads of 8 over 2 ranks
    grouped = Layout("w", 8, scale=8, rep=4)  # expanded to 8 query heads
    assert s.ranges(grouped) == (((0, 4),), ((4, 8),))


def test_contains_and_positions():
    s = specs(16, 4, Demand("w", 0, 16, 8))
    full = Layout("w", 16)
    q = Specs(4, {"q": RootSpec.build("q", 16, 4, [])})
    s.roots.update(q.roots)
    assert s.contains(full, Layout("q", 16))
    assert positions(((0, 16),), ((4, 8),)) == [(4, 8)]
    assert positions(((4, 8), (12, 16)), ((12, 14),)) == [(4, 6)]


def test_a_joined_root_lays_its_parts_cuts_end_to_end():
    # Flux's cat([attn, mlp]): 3 heads of 4 and 10 MLP features over 2 ranks; a rank holds its
    # heads, then its MLP features, and the joined dim's ranges are each part's shifted
    heads = RootSpec.build("q", 12, 2, [Demand("q", 0, 12, 4)])
    mlp = RootSpec.build("m", 10, 2, [])
    joined = RootSpec.joined("<cat>", 2, [(heads, 0, 12), (mlp, 0, 10)])
    s = Specs(2, {"q": heads, "m": mlp, "<cat>": joined})
    assert joined.parts == ("q", "m") and s.bases("<cat>") == ("q", "m") and s.bases("q") == ("q",)
    assert s.ranges(Layout("<cat>", 22)) == (((0, 8), (12, 17)), ((8, 12), (17, 22)))
    assert s.ranges(Layout("<cat>", 10, offset=12)) == s.ranges(Layout("m", 10))


def test_a_joined_root_keeps_a_parts_cut_range_only():
    # the part is the second of two fused chunks [8, 16) of a 16-wide root cut per chunk
    fused = RootSpec.build("w", 16, 2, [Demand("w", 0, 8), Demand("w", 8, 16)])
    joined = RootSpec.joined("<cat>", 2, [(fused, 8, 16), (fused, 0, 8)])
    s = Specs(2, {"w": fused, "<cat>": joined})
    assert s.ranges(Layout("<cat>", 16)) == (((0, 4), (8, 12)), ((4, 8), (12, 16)))
