"""View dim-grouping with symbolic sizes, and how layouts follow views and splits."""

from __future__ import annotations

import sympy

from tpcompile.passes.planner.dims import merge_layout, split_layout, sub_layout, view_groups
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
