"""Materialize: give one rank's graph its own shards of the weights, and nothing more.

Every parameter and buffer the captured module holds is replaced by a fresh tensor: the rank's
slice for sharded ones, a copy for replicated ones. The user's model is never modified and
shares no storage with the result, so the caller may free it. Tied weights (several FQNs, one
tensor) stay tied: every alias is set to the same new Parameter.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from tpcompile.placement import Shard
from tpcompile.plan import ShardingPlan

__all__ = ["materialize_params_pass", "take_shard", "set_tensor"]


def take_shard(t: torch.Tensor, placement, specs, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor (a copy for replicated placements)."""
    if not isinstance(placement, Shard):
        return t.detach().clone()
    pieces = [t.detach().narrow(placement.dim, s, e - s)
              for s, e in specs.ranges(placement.layout)[rank]]
    return torch.cat(pieces, placement.dim) if pieces else t.detach().narrow(placement.dim, 0, 0).clone()


def set_tensor(root: nn.Module, fqn: str, value) -> None:
    """Put ``value`` (a Parameter or buffer) at ``fqn`` under ``root``, replacing the old one."""
    owner, _, leaf = fqn.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    if isinstance(value, nn.Parameter):
        mod._parameters[leaf] = value
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        setattr(mod, leaf, value)


def materialize_params_pass(gm: fx.GraphModule, plan: ShardingPlan, rank: int) -> fx.GraphModule:
    specs = plan.specs
    by_id: dict[int, list[str]] = {}
    tensors = list(gm.named_parameters(remove_duplicate=False)) + list(
        gm.named_buffers(remove_duplicate=False))
    for name, t in tensors:
        by_id.setdefault(id(t), []).append(name)
    done = set()
    for name, t in tensors:
        if id(t) in done:
            continue
        done.add(id(t))
        names = by_id[id(t)]
        entry = next((plan.params[n] for n in names if n in plan.params), None)
        placement = entry.placement if entry is not None else None
        local = take_shard(t, placement, specs, rank)
        if isinstance(t, nn.Parameter):
            local = nn.Parameter(local, requires_grad=t.requires_grad)
        for n in names:
            set_tensor(gm, n, local)
    return gm
