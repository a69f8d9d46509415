"""Gradient clipping by the global norm of a tensor-parallel model's gradients.

``torch.nn.utils.clip_grad_norm_`` on ``tp.parameters()`` would measure each rank's shards
only, so every rank would clip by a different, too small norm. The global norm is the norm of
the unsharded gradients: a sharded gradient contributes each of its global indices once (from
the rank that owns it, see :mod:`tpcompile.core.shards`, since blocks replicated inside a sharded
chain are held by several ranks), and a replicated gradient, which is whole and equal on
every rank (Megatron's convention), contributes once, computed locally without communication.
One all-reduce of a scalar per call (two under FSDP2: over tp, then over dp).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from tpcompile.runtime.module import TPModule
from tpcompile.state.chunks import held_chunks, local_of

__all__ = ["grad_norm", "clip_grad_norm_"]


def _grad_parts(tp: TPModule):
    """(owned chunks of sharded grads, whole replicated grads, the FSDP2 group or None)."""
    sharded, replicated, dp_group = [], [], None
    for name, p in tp.named_parameters():
        if p.grad is None:
            continue
        held = held_chunks(tp.plan, name, p.grad, tp.rank)
        if held is None:
            replicated.append(p.grad)
        else:
            sharded += [c.view for c in held[1] if c.owned]
        if isinstance(p.grad, DTensor):
            dp_group = p.grad.device_mesh.get_group()
    return sharded, replicated, dp_group


def grad_norm(tp: TPModule, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the unsharded gradients, the same on every rank (a collective).

    Under FSDP2 (``fully_shard`` over a data-parallel mesh dimension) the owned chunks are
    summed over the tensor-parallel group, then over FSDP2's group.
    """
    norm_type = float(norm_type)
    sharded, replicated, dp_group = _grad_parts(tp)
    device = local_of(next(tp.parameters())).device
    parts = [get_total_norm(ts, norm_type).to(device) if ts else torch.zeros((), device=device)
             for ts in (sharded, replicated)]
    groups = [tp.group] + ([dp_group] if dp_group is not None else [])
    if math.isinf(norm_type):
        for group in groups:
            dist.all_reduce(parts[0], op=dist.ReduceOp.MAX, group=group)
        return torch.maximum(parts[0], parts[1])
    powered = parts[0].double() ** norm_type
    for group in groups:
        dist.all_reduce(powered, group=group)
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
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grads_with_norm_ rule
    grads = [local_of(p.grad) for p in tp.parameters() if p.grad is not None]  # FSDP2: its shard
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
