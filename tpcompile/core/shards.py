"""Where each global index of a sharded tensor lives: held, owned, and its place in the shard.

A rank's local tensor is the concatenation, along the shard dim, of the global index ranges
``plan.specs.ranges(layout)[rank]`` in order. Ranges can be uneven, several per rank (a fused
qkv weight), and *overlapping*: a block with fewer heads than ranks is held by every rank.

Anything that must count or write every global index exactly once (a gradient norm, a
checkpoint) needs an owner per index. The owner is the lowest rank that holds it, the same rule
the all-gather uses (:func:`gather_args`). :func:`pieces` cuts a rank's ranges at
the ownership boundaries so that each :class:`Piece` is either wholly owned by this rank or
wholly owned by a lower one, and knows where it sits in the local tensor. Checkpoints address
pieces by their global start, so the cut is the same whether a rank writes (owned pieces only)
or reads (all of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpcompile.core.placement import Shard, Specs, merge_ranges
from tpcompile.core.plan import ShardingPlan

__all__ = ["Piece", "owned_ranges", "pieces", "placements_by_fqn", "shard_pieces",
           "gather_args", "take_shard"]

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Piece:
    """Global indices ``[start, stop)`` of the shard dim, stored from ``local`` in the shard."""

    start: int
    stop: int
    local: int
    owned: bool

    @property
    def size(self) -> int:
        return self.stop - self.start

    def of_local(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """This piece as a view of the rank's local tensor."""
        return local.narrow(dim, self.local, self.size)

    def of_full(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This piece as a view of the unsharded tensor."""
        return full.narrow(dim, self.start, self.size)


def _cut(start: int, stop: int, taken: list[tuple[int, int]]):
    """Split ``[start, stop)`` into (start, stop, free) runs against the sorted ``taken``."""
    pos = start
    for s, e in taken:
        if e <= pos or s >= stop:
            continue
        if s > pos:
            yield pos, s, True
        yield max(s, pos), min(e, stop), False
        pos = min(e, stop)
    if pos < stop:
        yield pos, stop, True


def pieces(per_rank: tuple[Ranges, ...], rank: int) -> tuple[Piece, ...]:
    """``rank``'s held ranges, in local order, cut where ownership changes."""
    lower = merge_ranges(r for held in per_rank[:rank] for r in held)
    out, local = [], 0
    for s, e in per_rank[rank]:
        for a, b, free in _cut(s, e, lower):
            out.append(Piece(a, b, local + a - s, free))
        local += e - s
    return tuple(out)


def owned_ranges(per_rank: tuple[Ranges, ...]) -> tuple[Ranges, ...]:
    """Per rank, the global ranges it owns; together they cover every held index once."""
    return tuple(tuple((p.start, p.stop) for p in pieces(per_rank, r) if p.owned)
                 for r in range(len(per_rank)))


def placements_by_fqn(plan: ShardingPlan) -> dict[str, object]:
    """Every FQN (tied aliases included) -> its placement in the plan."""
    return {name: entry.placement for name, entry in plan.by_fqn.items()}


def shard_pieces(plan: ShardingPlan, placement, rank: int) -> tuple[Piece, ...] | None:
    """The pieces of a tensor placed ``placement`` on ``rank``; None when it is replicated."""
    if not isinstance(placement, Shard):
        return None
    return pieces(plan.specs.ranges(placement.layout), rank)


def gather_args(specs: Specs, layout, rank: int, world_size: int):
    """(width, index, mine, keep) for :func:`tpcompile.runtime.collectives.all_gather`."""
    ranges = specs.ranges(layout)
    sizes = [sum(e - s for s, e in r) for r in ranges]
    width = max(sizes)
    even = all(r == ((k * width, (k + 1) * width),) for k, r in enumerate(ranges))
    owner, where = {}, {}
    for k, held in enumerate(ranges):
        pos = 0
        for s, e in held:
            for i in range(s, e):
                if i not in owner:
                    owner[i], where[i] = k, k * width + pos + i - s
            pos += e - s
    index = None if even and layout.size == width * world_size else [where[i] for i in range(layout.size)]
    keep = None
    if specs.overlaps(layout):
        keep = [float(owner[i] == rank) for s, e in ranges[rank] for i in range(s, e)]
    return width, index, list(ranges[rank]), keep


def take_shard(t: torch.Tensor, placement, specs: Specs, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor (a copy for replicated placements)."""
    if not isinstance(placement, Shard):
        return t.detach().clone()
    pieces = [t.detach().narrow(placement.dim, s, e - s)
              for s, e in specs.ranges(placement.layout)[rank]]
    return torch.cat(pieces, placement.dim) if pieces else t.detach().narrow(placement.dim, 0, 0).clone()
