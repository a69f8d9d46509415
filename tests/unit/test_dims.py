"""View dim-grouping with symbolic sizes, and how layouts follow views and splits."""

from __future__ import annotations

import sympy

from tpcompile.passes.planner.dims import (
    merge_layout, split_layout, sub_layout, tile_layout, untile_layout, view_groups,
)
from tpcompile.core.placement import Layout

s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)


def test_groups_split_and_merge_with_symbols():
    assert view_groups((s0, s1, 64), (s0, s1, 8, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_groups((s0, s1, 8, 8), (s0 * s1, 64)) == [([0, 1], [0]), ([2, 3], [1])]
    assert view_groups((2, 5, 1, 4), (10, 4)) == [([0, 1], [0]), ([2], []), ([3], [1])]
    assert view_groups((6,), (2, 4)) is None


def test_layouts_through_views():
    flat = Layout("w", 64)
    heads = split_layout(flat, 8, 8)
    assert heads == Layout("w", 8, 0, 8, 1)
    assert merge_layout(heads, 8) == Layout("w", 64, 0, 8, 8)
    kv = Layout("w", 2, 0, 8, 1)
    assert merge_layout(kv, 4) == Layout("w", 8, 0, 8, 4)  # GQA: 2 kv heads -> 8 q heads
    assert sub_layout(Layout("w", 192), 64, 128) == Layout("w", 64, 64, 1, 1)


def test_groups_pair_the_ends_where_symbols_defeat_the_products():
    """A length padded to whole chunks: its products are not comparable, but a reshape that keeps
    its leading and trailing sizes keeps those dims (Mamba-2's and the gated delta rule's chunks)."""
    padded = s1 + sympy.Mod(-s1, 256)
    out = view_groups((s0, padded, 4, 16), (s0, padded // 256, 256, 4, 16))
    assert out == [([0], [0]), ([1], [1, 2]), ([2], [3]), ([3], [4])]


def test_a_symbolic_batch_merged_with_heads_is_a_symbolic_count_of_tiles():
    heads = Layout("w", 8, 0, 16, 1)
    tiled = tile_layout(heads, s0)  # (batch, heads) viewed as batch * heads, batch dynamic
    assert (tiled.tiles, tiled.size, tiled.tile_size) == (0, 8, 8)
    assert untile_layout(tiled) == heads
    assert tile_layout(heads, 3) == Layout("w", 24, 0, 16, 1, tiles=3)
    assert tile_layout(tile_layout(heads, 3), s0).tiles == 0  # still one tile's size: 8
    assert tile_layout(tile_layout(heads, 3), s0).size == 8
