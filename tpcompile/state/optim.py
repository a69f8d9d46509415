"""Gradient clipping by the global norm of a tensor-parallel model's gradients.

``torch.nn.utils.clip_grad_norm_`` on ``tp.parameters()`` would measure each rank's shards
only, so every rank would clip by a different, too small norm. The global norm is the norm of
the unsharded gradients: a sharded gradient contributes each of its global indices once (from
the rank that owns it, see :mod:`tpcompile.core.shards`, since blocks replicated inside a sharded
region are held by several ranks), and a replicated gradient, which is whole and equal on
every rank (Megatron's convention), contributes once, computed locally without communication.
One all-reduce of a scalar per call.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from tpcompile.runtime.module import TPModule
from tpcompile.core.shards import placements_by_fqn, shard_pieces

__all__ = ["grad_norm", "clip_grad_norm_"]


def _grad_parts(tp: TPModule):
    """(owned pieces of sharded grads, whole replicated grads) on this rank."""
    placements = placements_by_fqn(tp.plan)
    sharded, replicated = [], []
    for name, p in tp.named_parameters():
        if p.grad is None:
            continue
        placement = placements.get(name)
        pieces = shard_pieces(tp.plan, placement, tp.rank)
        if pieces is None:
            replicated.append(p.grad)
        else:
            sharded += [piece.of_local(p.grad, placement.dim) for piece in pieces if piece.owned]
    return sharded, replicated


def grad_norm(tp: TPModule, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the unsharded gradients, the same on every rank (a collective)."""
    norm_type = float(norm_type)
    sharded, replicated = _grad_parts(tp)
    device = next(tp.parameters()).device
    parts = [get_total_norm(ts, norm_type).to(device) if ts else torch.zeros((), device=device)
             for ts in (sharded, replicated)]
    if math.isinf(norm_type):
        dist.all_reduce(parts[0], op=dist.ReduceOp.MAX, group=tp.group)
        return torch.maximum(parts[0], parts[1])
    powered = parts[0].double() ** norm_type
    dist.all_reduce(powered, group=tp.group)
    total = (powered + parts[1].double() ** norm_type) ** (1.0 / norm_type)
    return total.to(parts[0].dtype)


def clip_grad_norm_(tp: TPModule, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale ``tp``'s gradients in place so their global norm is at most ``max_norm``.

    The tensor-parallel counterpart of ``torch.nn.utils.clip_grad_norm_`` (same scaling rule,
    ``max_norm / (norm + 1e-6)`` capped at 1); returns the global norm before clipping. Call it
    on every rank.
    """
    total = grad_norm(tp, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite; "
            "set error_if_nonfinite=False to clip anyway")
    clip_grads_with_norm_([p for p in tp.parameters() if p.grad is not None], max_norm, total)
    return total
