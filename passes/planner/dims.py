"""Shape arithmetic the sharding rules share: symbolic sizes, view dim-groups, layout transforms.

Sizes come from ``node.meta['val']`` and may be SymInts (dynamic batch / sequence); they are
compared as sympy expressions so that no guard is ever added to the capture's shape env.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import sympy
import torch
from torch import fx

from tpcompile.core.placement import Demand, Layout, Misaligned

__all__ = ["val", "shape", "hinted_shape", "size_expr", "example_size", "view_groups", "split_layout", "merge_layout", "sub_layout",
           "chunk_layout", "tile_layout", "untile_layout", "norm_dim", "agreeing_cut"]


def val(arg):
    """The FakeTensor (or tuple of them) an FX value carries; None for non-tensors."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    return None


def shape(arg) -> tuple:
    v = val(arg)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def hinted_shape(arg) -> tuple:
    """The sizes of ``arg`` as ints (a symbolic size at its example value); () for non-tensors."""
    return tuple(int(s) for s in shape(arg))


def size_expr(s):
    """An int for a static size, a sympy expression for a symbolic one."""
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        return int(expr) if expr.is_number else expr
    return s


def example_size(s) -> int:
    """A size at the example the graph was captured with (a SymInt's hint: no guard added)."""
    return s if isinstance(s, int) else int(s.node.hint)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _is_one(s) -> bool:
    return isinstance(s, int) and s == 1


def view_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Pair up dims of a reshape: [(src_dims, dst_dims)], each group having equal products.

    Size-1 dims form their own (possibly one-sided) groups. Where symbolic sizes defeat the
    pairing (a length padded to whole chunks, ``(L + pad) // 256``), the dims equal at both ends
    still pair one to one and the rest form one group: in row-major order a reshape that keeps
    its leading and trailing sizes keeps those dims. Returns None if the shapes do not line up,
    which the caller treats as "cannot follow the shard through this view".
    """
    a, b = [size_expr(s) for s in src], [size_expr(s) for s in dst]
    paired = _paired(a, b)
    if paired is None and not all(isinstance(s, int) for s in a + b):
        return _ends_paired(a, b)  # static sizes that do not pair are no view at all
    return paired


def _ends_paired(a: list, b: list) -> list[tuple[list[int], list[int]]] | None:
    n = min(len(a), len(b))
    lead = next((i for i in range(n) if not _equal(a[i], b[i])), n)
    trail = next((i for i in range(n - lead) if not _equal(a[-1 - i], b[-1 - i])), n - lead)
    if lead + trail == len(a) == len(b):
        return [([i], [i]) for i in range(len(a))]
    middle = (list(range(lead, len(a) - trail)), list(range(lead, len(b) - trail)))
    if not middle[0] or not middle[1]:
        return None
    return ([([i], [i]) for i in range(lead)] + [middle]
            + [([len(a) - trail + i], [len(b) - trail + i]) for i in range(trail)])


def _paired(a: list, b: list) -> list[tuple[list[int], list[int]]] | None:
    """Left to right: each group grows on the side whose product is smaller until they meet."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and _is_one(a[i]):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and _is_one(b[j]):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            return None
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while not _equal(pa, pb):
            if _smaller(pa, pb):
                if i >= len(a):
                    return None
                pa, gi = pa * a[i], gi + [i]
                i += 1
            else:
                if j >= len(b):
                    return None
                pb, gj = pb * b[j], gj + [j]
                j += 1
        groups.append((gi, gj))
    return groups


def _equal(pa, pb) -> bool:
    if isinstance(pa, int) and isinstance(pb, int):
        return pa == pb
    return _symbolic_equal(pa, pb)


# sympy.simplify costs milliseconds, and a model's views ask the same few questions many
# times (a chunked recurrence: hundreds of views of the same symbolic sizes), so the
# symbolic answers are kept; sympy expressions are immutable and hashable
@functools.lru_cache(maxsize=4096)
def _symbolic_equal(pa, pb) -> bool:
    return sympy.simplify(pa - pb) == 0


def _smaller(pa, pb) -> bool:
    """Whether product ``pa`` must grow to reach ``pb`` (symbols missing, or a smaller number)."""
    if isinstance(pa, int) and isinstance(pb, int):
        return pa < pb
    return _symbolic_smaller(pa, pb)


@functools.lru_cache(maxsize=4096)
def _symbolic_smaller(pa, pb) -> bool:
    num, den = sympy.fraction(sympy.simplify(sympy.sympify(pa) / pb))
    if den.free_symbols - num.free_symbols:
        return True
    if num.free_symbols - den.free_symbols:
        return False
    return bool(num.is_number and den.is_number and num < den)


def split_layout(layout: Layout, size: int, inner: int) -> Layout:
    """The layout of the leading dim when a sharded dim is viewed as (size, inner)."""
    if layout.rep == 1:
        return replace(layout, size=size, scale=layout.scale * inner)
    if inner % layout.rep == 0:
        return replace(layout, size=size, scale=layout.scale * inner // layout.rep, rep=1)
    if layout.rep % inner == 0:
        return replace(layout, size=size, rep=layout.rep // inner)
    lo, hi = layout.covered()
    raise Misaligned(Demand(layout.root, lo, hi, layout.scale * math.lcm(inner, layout.rep),
                            reason=f"view of {layout} by {inner} cuts repeated groups"))


def chunk_layout(layout: Layout, chunks: int, size: int, inner: int) -> Layout | None:
    """The layout of the second dim when a sharded dim is viewed as (chunks, size, inner):
    a fused projection with its chunk index split off (``view(B, T, 3, heads, head_dim)``).
    None where the dim is itself a view of repeated groups or of chunks."""
    if layout.rep != 1 or layout.copies != 1 or layout.cover:
        return None
    return replace(layout, size=size, scale=layout.scale * inner, copies=chunks,
                   period=layout.scale * size * inner)


def tile_layout(layout: Layout, outer) -> Layout:
    """The layout of (outer..., sharded) dims merged into one: ``outer`` tiles of the shard.
    A symbolic ``outer`` (a dynamic batch) leaves the count symbolic: ``tiles=0``, one tile's
    size kept."""
    if isinstance(outer, int) and layout.tiles:
        return replace(layout, size=layout.size * outer, tiles=layout.tiles * outer)
    return replace(layout, size=layout.tile_size, tiles=0)


def untile_layout(layout: Layout) -> Layout:
    """The layout of the sharded dim when a tiled dim is viewed as (tiles, sharded)."""
    return replace(layout, size=layout.tile_size, tiles=1)


def merge_layout(layout: Layout, inner: int) -> Layout:
    """The layout of (sharded, inner...) dims merged into one."""
    return replace(layout, size=layout.size * inner, rep=layout.rep * inner)


def sub_layout(layout: Layout, start: int, stop: int) -> Layout:
    """The layout of indices [start, stop) of a sharded dim (a split chunk)."""
    if start % layout.rep:
        lo, hi = layout.covered()
        raise Misaligned(Demand(layout.root, lo, hi, layout.scale * layout.rep,
                                reason=f"chunk at {start} cuts repeated groups of {layout}"))
    return replace(layout, size=stop - start, offset=layout.offset + start // layout.rep * layout.scale)


def agreeing_cut(a: Layout, b: Layout) -> list[Demand]:
    """Demands on the plainer root that make two layouts of one dim (a query's heads and the
    key heads they read) hold the same indices on every rank; [] where none would.

    Grouped-query heads repeated in place (``rep``: Llama's expand of each kv head) need the
    plain root cut in whole groups. Repeated as tiles (``tiles``: x-transformers' ``repeat(k,
    'b kvh n d -> b (r kvh) n d')``, query head ``h`` reading kv head ``h % kvh``) they need it
    cut in ``tiles`` blocks, each split like one tile: the rank's kv heads' queries in each."""
    if a.size != b.size:
        return []
    if a.rep != b.rep:
        plain, grouped = (a, b) if a.rep < b.rep else (b, a)
        lo, hi = plain.covered()
        return [Demand(plain.root, lo, hi, plain.scale * grouped.rep // plain.rep,
                       reason=f"{plain.root} must be cut in whole groups of {grouped.root}")]
    plain, tiled = (a, b) if a.tiles < b.tiles else (b, a)
    lo, hi = plain.covered()
    if (plain.tiles != 1 or tiled.tiles <= 1 or plain.rep != 1 or plain.copies != 1 or plain.cover
            or (hi - lo) % (tiled.tiles * plain.scale)):
        return []
    width = (hi - lo) // tiled.tiles
    return [Demand(plain.root, lo + t * width, lo + (t + 1) * width, plain.scale,
                   reason=f"{plain.root} must be cut like each of the {tiled.tiles} tiles of "
                          f"{tiled.root} its heads read")
            for t in range(tiled.tiles)]
