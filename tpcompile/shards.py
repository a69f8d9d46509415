"""Where each global index of a sharded tensor lives: held, owned, and its place in the shard.

A rank's local tensor is the concatenation, along the shard dim, of the global index ranges
``plan.specs.ranges(layout)[rank]`` in order. Ranges can be uneven, several per rank (a fused
qkv weight), and *overlapping*: a block with fewer heads than ranks is held by every rank.

Anything that must count or write every global index exactly once (a gradient norm, a
checkpoint) needs an owner per index. The owner is the lowest rank that holds it, the same rule
the all-gather uses (``insert_collectives.gather_args``). :func:`pieces` cuts a rank's ranges at
the ownership boundaries so that each :class:`Piece` is either wholly owned by this rank or
wholly owned by a lower one, and knows where it sits in the local tensor. Checkpoints address
pieces by their global start, so the cut is the same whether a rank writes (owned pieces only)
or reads (all of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpcompile.placement import Shard
from tpcompile.plan import ShardingPlan

__all__ = ["Piece", "owned_ranges", "pieces", "placements_by_fqn", "shard_pieces"]

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


def _union(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(r for r in ranges if r[0] < r[1]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


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
    lower = _union(r for held in per_rank[:rank] for r in held)
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
