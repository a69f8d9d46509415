"""Which blocks of an unsharded tensor a rank holds, under tensor parallelism and FSDP2 both.

Tensor parallelism gives a rank :class:`~tpcompile.core.shards.Piece` s of a tensor along its
shard dim (several ranges, some held by several ranks). FSDP2's ``fully_shard`` over a data-
parallel mesh dimension then shards that *local* tensor again along dim 0 (a ``DTensor`` whose
"global" shape is the tensor-parallel shard). A :class:`Chunk` is the intersection: a box of the
unsharded tensor (offsets, sizes), the view of this rank's memory that holds it, and whether this
rank owns it (each global index is owned by exactly one rank of the whole mesh, so checkpoints
write it once and norms count it once). Checkpoints and gradient clipping both read this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from tpcompile.core.plan import ShardingPlan
from tpcompile.core.shards import shard_pieces

__all__ = ["Chunk", "held_chunks", "local_of", "data_parallel_rows"]


@dataclass(frozen=True, eq=False)
class Chunk:
    """A box of the unsharded tensor held by this rank, and the local view holding it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    owned: bool
    view: torch.Tensor


def local_of(value: torch.Tensor) -> torch.Tensor:
    """The tensor in this rank's memory (an FSDP2 ``DTensor``'s local shard, else itself)."""
    return value.to_local() if isinstance(value, DTensor) else value


def data_parallel_rows(value: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of the tensor-parallel shard that this rank's FSDP2 shard holds."""
    if not isinstance(value, DTensor):
        return 0, value.shape[0] if value.ndim else 1
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return offset[0], shape[0]


def held_chunks(plan: ShardingPlan, fqn: str, value: torch.Tensor, tp_rank: int):
    """(global shape, chunks) of ``value`` (a parameter, gradient or optimizer state shaped like
    parameter ``fqn``) on this rank; None for a whole, unsharded tensor (replicated, no FSDP).
    """
    entry = plan.by_fqn.get(fqn)
    pieces = None if entry is None else shard_pieces(plan, entry.placement, tp_rank)
    fsdp = isinstance(value, DTensor)
    if pieces is None and not fsdp:
        return None
    local = local_of(value)
    r0, n = data_parallel_rows(value)
    tp_shape = tuple(value.shape)
    if pieces is None:  # replicated across tp, sharded by FSDP: tp rank 0 owns it
        return tp_shape, _nonempty([Chunk((r0,) + (0,) * (len(tp_shape) - 1),
                                          (n,) + tp_shape[1:], tp_rank == 0, local)])
    dim, global_shape = entry.placement.dim, tuple(entry.global_shape)
    chunks = []
    for piece in pieces:
        offsets, sizes = [0] * len(global_shape), list(global_shape)
        if dim != 0:
            offsets[dim], sizes[dim] = piece.start, piece.size
            offsets[0], sizes[0] = r0, n
            view = local.narrow(dim, piece.local, piece.size)
        else:  # the FSDP rows cut the pieces, which lie end to end along dim 0
            a, b = max(piece.local, r0), min(piece.local + piece.size, r0 + n)
            if a >= b:
                continue
            offsets[0], sizes[0] = piece.start + a - piece.local, b - a
            view = local.narrow(0, a - r0, b - a)
        chunks.append(Chunk(tuple(offsets), tuple(sizes), piece.owned, view))
    return global_shape, _nonempty(chunks)


def _nonempty(chunks: list[Chunk]) -> list[Chunk]:
    return [c for c in chunks if all(s > 0 for s in c.sizes)]
