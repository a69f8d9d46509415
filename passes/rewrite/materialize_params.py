"""Materialize: give one rank's graph its own shards of the weights, and nothing more.

Every parameter and buffer the captured module holds is replaced by a fresh tensor: the rank's
slice for sharded ones, a copy for replicated ones. The user's model is never modified and
shares no storage with the result, so the caller may free it. Tied weights (several FQNs, one
tensor) stay tied: every alias is set to the same new Parameter. A tensor constant export
lifted (a plain tensor attribute forward reads, ``lifted_tensor_0``) is no parameter or
buffer; one the plan shards gets its slice too (SANA-WM's refiner multiplies a cut projection
by a table it keeps as an attribute).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from tpcompile.core.capture import fetch, set_tensor
from tpcompile.core.plan import ShardingPlan
from tpcompile.core.shards import take_shard

__all__ = ["materialize_params_pass"]


def materialize_params_pass(gm: fx.GraphModule, plan: ShardingPlan, rank: int) -> fx.GraphModule:
    specs = plan.specs
    by_id: dict[int, list[str]] = {}
    tensors = list(gm.named_parameters(remove_duplicate=False)) + list(
        gm.named_buffers(remove_duplicate=False))
    constants = {n.target for n in gm.graph.nodes if n.op == "get_attr"} - {n for n, _ in tensors}
    tensors += [(name, t) for name in sorted(constants & plan.params.keys())  # placed constants
                if isinstance(t := fetch(gm, name), torch.Tensor)]
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
