"""Placements of a tensor across tensor-parallel ranks, and exact (possibly uneven) shard layouts.

The vocabulary is DTensor's: ``Replicate()``, ``Shard(dim)``, ``Partial()``. A tpcompile ``Shard``
also carries a :class:`Layout` that says which global indices of ``dim`` each rank holds, so
shards can be uneven (11008 over 3 ranks), head-aligned (whole heads only) and blockwise (a
fused qkv weight sharded per q/k/v chunk, with blocks that are too small to split replicated).

Every layout derives from a *root*: the output-feature dimension of one column-parallel
weight, or a *joined* root: the dimension of a ``cat`` of shards of other roots, each part's
blocks laid end to end (:meth:`RootSpec.joined`). A root is cut into blocks; each block is
split over the ranks in whole *units* (``torch.tensor_split`` counts: the first ranks get one
unit more) or, when it has fewer units than ranks, replicated on all of them. A derived layout maps index ``i`` of its own dimension to
root indices ``[offset + (i // rep) * scale, ... + scale)``: ``scale`` appears when a feature
dimension is viewed as ``(heads, head_dim)``, ``rep`` when grouped-query heads are repeated.
``copies`` appears when a fused dimension is viewed with its chunk index split off
(``qkv.view(B, T, 3, heads, head_dim)``): the dimension then indexes within each of ``copies``
root ranges ``period`` apart, and every rank must hold the same indices of each, which the
chunks' blocks guarantee (each chunk one block, cut alike). ``tiles`` appears when whole dims
are merged in front of a sharded one (``(batch, heads)`` viewed as ``batch * heads``): the
dimension is that many tiles, each holding the rank's indices of the sharded one. A symbolic
batch makes the count symbolic: ``tiles=0``, ``size`` is then one tile's, and index ranges are
those of every tile.

Everything here is rank-independent data: one plan describes every rank, and per-rank index
ranges are computed from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

__all__ = [
    "Replicate", "Shard", "Partial", "Placement", "Layout", "Demand", "RootSpec", "Block",
    "Misaligned", "each", "merge_ranges",
]

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand; the tensor is the sum over ranks. ``reduce="max"`` (or
    ``"min"``): every rank holds a candidate, the tensor is their maximum (a max over a cut
    dim before its all-reduce, :mod:`tpcompile.passes.planner.rules.extrema`); only the ops
    that know it read such a partial without reducing it first."""

    reduce: str = "sum"

    def __str__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({self.reduce})"


@dataclass(frozen=True)
class Layout:
    """Which indices of one dimension each rank holds, as a view of a root's split."""

    root: str
    size: int
    offset: int = 0
    scale: int = 1
    rep: int = 1
    # a rank holds every index whose root unit its cut touches, not only whole ones: the kv
    # heads a rank's query heads read when there are fewer kv heads than ranks
    cover: bool = False
    copies: int = 1
    period: int = 0
    # the dimension is ``tiles`` whole dims merged in front of the sharded one, each tile the
    # same indices: (batch, heads) viewed as batch * heads (BART's bmm attention); 0 when the
    # merged dims are symbolic (a dynamic batch): ``size`` is then one tile's
    tiles: int = 1

    def covered(self) -> tuple[int, int]:
        """The root indices this dimension spans (in every copy)."""
        return self.offset, self.offset + (self.copies - 1) * self.period + self.span

    @property
    def tile_size(self) -> int:
        """The indices of one tile (the whole dimension when it is not tiled)."""
        return self.size // self.tiles if self.tiles else self.size

    @property
    def span(self) -> int:
        """The root indices one copy spans."""
        return -(-self.tile_size // self.rep) * self.scale

    def __str__(self) -> str:
        extra = "".join(
            f"{k}={v}" for k, v in (("+", self.offset), ("*", self.scale), ("rep", self.rep))
            if v != (0 if k == "+" else 1)
        ) + (" cover" if self.cover else "") + (
            f" x{self.copies}/{self.period}" if self.copies > 1 else "") + (
            f" tiles={self.tiles or '*'}" if self.tiles != 1 else "")
        return f"{self.root}[{self.size}{' ' + extra if extra else ''}]"


@dataclass(frozen=True)
class Shard:
    """Each rank holds the indices of ``dim`` that ``layout`` assigns it."""

    dim: int
    layout: Layout

    def __str__(self) -> str:
        return f"S({self.dim})"


Placement = Replicate | Shard | Partial


def each(p) -> list:
    """The placements of a node's output: one for a tensor, one per element of a list output
    (split, chunk, unbind); ``None`` stands for a non-tensor element."""
    return list(p) if isinstance(p, (list, tuple)) else [p]


@dataclass(frozen=True)
class Demand:
    """A constraint on how a root may be cut, found while propagating placements.

    ``unit``: root indices ``[start, stop)`` must be split in whole multiples of ``unit``
    (whole attention heads, whole GQA groups). ``replicate``: keep that range on every rank.
    """

    root: str
    start: int
    stop: int
    unit: int = 1
    replicate: bool = False
    reason: str = ""


class Misaligned(Exception):
    """A derived layout cuts through a unit of its root; carries the demands that fix it."""

    def __init__(self, *demands: Demand):
        super().__init__(demands[0].reason)
        self.demands = demands


@dataclass(frozen=True)
class Block:
    """Root indices ``[start, stop)``: split over the ranks in whole ``unit``s, replicated on
    every rank, or (``owner``) held whole by that one rank and by no other: a looped expert
    assigned whole (``passes/planner/experts/looped.py``)."""

    start: int
    stop: int
    unit: int
    replicated: bool
    owner: int | None = None


@dataclass(frozen=True)
class RootSpec:
    """How the root ``name`` (a weight's output-feature dimension of length ``size``) is cut."""

    name: str
    size: int
    world_size: int
    blocks: tuple[Block, ...]
    # the roots a joined root is laid end to end from (:meth:`joined`); empty for a weight's
    parts: tuple[str, ...] = ()

    @staticmethod
    def build(name: str, size: int, world_size: int, demands: list[Demand]) -> "RootSpec":
        cuts = {0, size}
        for d in demands:
            cuts.update((d.start, d.stop))
        cuts = sorted(c for c in cuts if 0 <= c <= size)
        blocks = []
        for start, stop in zip(cuts, cuts[1:]):
            covering = [d for d in demands if d.start <= start and stop <= d.stop]
            unit = math.lcm(1, *(d.unit for d in covering))
            replicated = any(d.replicate for d in covering)
            if (stop - start) % unit or (stop - start) // unit < world_size:
                replicated = True  # too few whole units for every rank: keep the block whole
            blocks.append(Block(start, stop, unit, replicated))
        return RootSpec(name, size, world_size, tuple(blocks))

    @staticmethod
    def joined(name: str, world_size: int, parts: list[tuple["RootSpec", int, int]]) -> "RootSpec":
        """The root of a ``cat`` of shards of other roots: root ranges ``[lo, hi)`` of each
        part laid end to end, each keeping its root's blocks (Flux's ``cat([attn, mlp])``: a
        rank holds its heads, then its MLP features). Whether a part's blocks clip into whole
        units is for the caller to check (the ranks' ranges of each part must be its own)."""
        blocks, base = [], 0
        for spec, lo, hi in parts:
            for b in spec.blocks:
                start, stop = max(b.start, lo), min(b.stop, hi)
                if start < stop:
                    blocks.append(replace(b, start=base + start - lo, stop=base + stop - lo))
            base += hi - lo
        names = tuple(spec.name for spec, _, _ in parts)
        return RootSpec(name, base, world_size, tuple(blocks), names)

    @cached_property
    def owned(self) -> tuple[Ranges, ...]:
        """Per rank, the root index ranges it holds (blocks in order, adjacent ranges merged)."""
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.world_size)]
        for b in self.blocks:
            if b.owner is not None:
                for rank, r in enumerate(per_rank):
                    r.append((b.start, b.stop if rank == b.owner else b.start))
                continue
            if b.replicated:
                for r in per_rank:
                    r.append((b.start, b.stop))
                continue
            n_units = (b.stop - b.start) // b.unit
            q, extra = divmod(n_units, self.world_size)
            pos = b.start
            for rank, r in enumerate(per_rank):
                n = (q + (rank < extra)) * b.unit
                r.append((pos, pos + n))
                pos += n
        return tuple(merge_ranges(r) for r in per_rank)

    @property
    def fully_replicated(self) -> bool:
        return all(b.replicated for b in self.blocks)


def merge_ranges(ranges) -> Ranges:
    """Sorted, disjoint ``[start, stop)`` ranges covering the same indices (empty ones dropped)."""
    out: list[list[int]] = []
    for s, e in sorted(r for r in ranges if r[0] < r[1]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return tuple((s, e) for s, e in out)


@dataclass
class Specs:
    """The cut of every root, and per-rank index ranges of any layout derived from them."""

    world_size: int
    roots: dict[str, RootSpec] = field(default_factory=dict)
    _cache: dict[Layout, tuple[Ranges, ...]] = field(default_factory=dict, repr=False)

    def bases(self, root: str) -> tuple[str, ...]:
        """The weights' roots behind ``root``: a joined root's parts, else ``root`` itself."""
        spec = self.roots.get(root)
        return spec.parts if spec is not None and spec.parts else (root,)

    def ranges(self, layout: Layout) -> tuple[Ranges, ...]:
        """Per rank, the index ranges of the layout's dimension it holds; raises Misaligned."""
        hit = self._cache.get(layout)
        if hit is None:
            hit = self._cache[layout] = self._compute(layout)
        return hit

    def _compute(self, layout: Layout) -> tuple[Ranges, ...]:
        if layout.tiles == 0:  # a symbolic number of tiles: the ranges within each one
            return self.ranges(replace(layout, tiles=1))
        if layout.tiles > 1:  # each tile holds what one untiled dim holds
            tile = layout.size // layout.tiles
            one = self.ranges(replace(layout, size=tile, tiles=1))
            return tuple(merge_ranges((t * tile + s, t * tile + e) for t in range(layout.tiles)
                                      for s, e in ranges) for ranges in one)
        spec = self.roots[layout.root]
        per_copy = [self._copy(spec, layout, layout.offset + c * layout.period)
                    for c in range(layout.copies)]
        if any(ranges != per_copy[0] for ranges in per_copy[1:]):
            raise _by_copy(layout, f"{layout} needs its {layout.copies} chunks cut alike")
        return per_copy[0]

    def _copy(self, spec: RootSpec, layout: Layout, lo: int) -> tuple[Ranges, ...]:
        """Per rank, the indices of one copy (at root index ``lo``) it holds."""
        hi = lo + layout.span
        out = []
        for owned in spec.owned:
            mine = []
            for s, e in owned:
                s, e = max(s, lo), min(e, hi)
                if s >= e:
                    continue
                if not layout.cover and ((s - lo) % layout.scale or (e - lo) % layout.scale):
                    raise _by_copy(layout, f"{layout} needs {layout.root} cut in units of {layout.scale}")
                a = (s - lo) // layout.scale * layout.rep
                b = min(-(-(e - lo) // layout.scale) * layout.rep, layout.size)
                mine.append((a, b))
            out.append(merge_ranges(mine))
        return tuple(out)

    def local_size(self, layout: Layout, rank: int) -> int:
        return sum(e - s for s, e in self.ranges(layout)[rank])

    def is_full(self, layout: Layout) -> bool:
        """Every rank holds every index (the layout is replicated)."""
        return all(r == ((0, layout.size),) for r in self.ranges(layout))

    def overlaps(self, layout: Layout) -> bool:
        """Some index is held by more than one rank."""
        return sum(e - s for r in self.ranges(layout) for s, e in r) > layout.size

    def same(self, a: Layout, b: Layout) -> bool:
        return a.size == b.size and a.tiles == b.tiles and self.ranges(a) == self.ranges(b)

    def contains(self, outer: Layout, inner: Layout) -> bool:
        """Each rank's ``inner`` indices are among its ``outer`` indices (a local slice suffices)."""
        if (outer.tiles == 0) != (inner.tiles == 0):  # ranges within a tile vs of the whole dim
            return False
        for ro, ri in zip(self.ranges(outer), self.ranges(inner)):
            for s, e in ri:
                if not any(os <= s and e <= oe for os, oe in ro):
                    return False
        return True


def _by_copy(layout: Layout, reason: str) -> Misaligned:
    """The demands that cut each copy of ``layout`` as one block in its units, so all copies
    are cut alike."""
    starts = range(layout.offset, layout.covered()[1], layout.period) if layout.copies > 1 else [layout.offset]
    return Misaligned(*(Demand(layout.root, s, s + layout.span, layout.scale, reason=reason)
                        for s in starts))


def positions(held: Ranges, wanted: Ranges) -> list[tuple[int, int]]:
    """Where the ``wanted`` global ranges sit inside a local tensor holding ``held`` in order."""
    out = []
    for s, e in wanted:
        base = 0
        for hs, he in held:
            if hs <= s and e <= he:
                out.append((base + s - hs, base + e - hs))
                break
            base += he - hs
        else:
            raise AssertionError(f"{(s, e)} not held in {held}")
    return out
