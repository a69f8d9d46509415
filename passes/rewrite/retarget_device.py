"""Retarget device constants that capture baked into a graph.

``torch.export`` records the device of every factory call in the graph: ``torch.full((T, T),
..., device=x.device)`` becomes ``aten.full(..., device=<the example input's device>)``. A model
captured on the meta device (to build it without memory) therefore holds ``device='meta'``
ops, which would create meta tensors on every call once its shards are real. This pass moves
each such argument to the device the shards were allocated on.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["retarget_device_pass", "baked_devices"]


def _swap(value, src: torch.device, dst: torch.device):
    if isinstance(value, torch.device) and value.type == src.type:
        return dst
    if isinstance(value, (list, tuple)):
        swapped = [_swap(v, src, dst) for v in value]
        if any(a is not b for a, b in zip(swapped, value)):
            return type(value)(swapped)
    return value


def baked_devices(gm: fx.GraphModule) -> set[torch.device]:
    """Every device constant the graph's ops were called with."""
    found: set[torch.device] = set()

    def visit(value):
        if isinstance(value, torch.device):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for node in gm.graph.nodes:
        visit(node.args)
        visit(tuple(node.kwargs.values()))
    return found


def retarget_device_pass(gm: fx.GraphModule, src: torch.device, dst: torch.device) -> fx.GraphModule:
    """Replace every ``src`` device constant in the graph's op arguments by ``dst``."""
    src, dst = torch.device(src), torch.device(dst)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        node.args = _swap(node.args, src, dst)
        node.kwargs = {k: _swap(v, src, dst) for k, v in node.kwargs.items()}
    return gm
