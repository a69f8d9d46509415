"""Retarget device constants that capture baked into a graph.

``torch.export`` records the device of every factory call in the graph: ``torch.full((T, T),
..., device=x.device)`` becomes ``aten.full(..., device=<the example input's device>)``. A model
captured on the meta device (to build it without memory) therefore holds ``device='meta'``
ops, which would create meta tensors on every call once its shards are real. This pass moves
each such argument to the device the shards live on: in the pipeline for a graph captured from
a meta copy of a real model (a further call signature), and from
:func:`tpcompile.state.meta_init.to_empty` once a model built on meta gets real shards (the
device is known only then, long after the pipeline ran).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

__all__ = ["retarget_device_pass", "baked_devices"]


def _swap(value, src: torch.device, dst: torch.device):
    if isinstance(value, torch.device) and value.type == src.type:
        return dst
    if isinstance(value, (list, tuple)):
        swapped = [_swap(v, src, dst) for v in value]
        if any(a is not b for a, b in zip(swapped, value)):
            return type(value)(swapped)
    return value


def _graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the graphs nested in it (the bodies of ``wrap_with_set_grad_enabled`` and
    other higher-order ops, which torch 2.11's export emits around ``no_grad`` scopes)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def baked_devices(gm: fx.GraphModule) -> set[torch.device]:
    """Every device constant the graph's ops (nested graphs' too) were called with."""
    found: set[torch.device] = set()

    def visit(value):
        if isinstance(value, torch.device):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for g in _graphs(gm):
        for node in g.graph.nodes:
            visit(node.args)
            visit(tuple(node.kwargs.values()))
    return found


def retarget_device_pass(gm: fx.GraphModule, device: torch.device | None) -> PassResult:
    """device='meta' -> ``device`` in the graph's op arguments; None leaves them as captured."""
    if device is None:
        return PassResult(gm, False)
    src, dst = torch.device("meta"), torch.device(device)
    changed = False
    for g in _graphs(gm):
        nested = False
        for node in g.graph.nodes:
            if node.op != "call_function":
                continue
            args = _swap(node.args, src, dst)
            kwargs = {k: _swap(v, src, dst) for k, v in node.kwargs.items()}
            if args is not node.args or any(kwargs[k] is not v for k, v in node.kwargs.items()):
                node.args, node.kwargs, nested = args, kwargs, True
        if nested and g is not gm:
            g.recompile()  # the caller recompiles gm
        changed |= nested
    return PassResult(gm, changed)
