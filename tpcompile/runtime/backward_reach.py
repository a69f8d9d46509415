"""Which nodes of a graph take part in its backward: a gradient sync runs only there.

An inserted call's backward collective (``copy_into_chain``'s all-reduce, a gather's
reduce-scatter) runs only if autograd reaches the call: its value must carry a gradient (it
depends on a trainable parameter or an input that requires grad, outside ``no_grad``) and
the gradient must come back to it (it leads to a floating output through differentiable
ops). A sync of a model input no gradient is asked of (a diffusion timestep), or of a value
only a discarded output reads, is in the graph but never runs; counting it would make the
report disagree with the run.

Gradient is seeded where the graph's own tensors say so: a placeholder's ``meta['val']`` (the
example input's ``requires_grad``) and a ``get_attr`` tensor's ``requires_grad`` (frozen
weights carry none). In-place writes pass a gradient into the tensor they write, so its
later readers carry one and the written values are reached through them.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["backward_nodes"]

_STOPS = {torch.ops.aten.detach.default, torch.Tensor.detach, torch.detach}


def _floating(node: fx.Node) -> bool:
    """Whether the node's value can hold a gradient; unknown (a node a pass inserted, a tuple)
    counts as yes, its inputs deciding."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.is_floating_point() or val.is_complex()
    return True


def _in_place(node: fx.Node) -> bool:
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    return name.endswith("_") and not name.startswith("_") and bool(node.args) \
        and isinstance(node.args[0], fx.Node)


def _seed(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "placeholder":
        return bool(getattr(node.meta.get("val"), "requires_grad", False))
    try:
        value = operator.attrgetter(node.target)(gm)
    except AttributeError:
        value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.requires_grad


def _carrying(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value requires grad when the graph runs with grad enabled."""
    carry, enabled = set(), True
    for node in gm.graph.nodes:
        if node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif node.op in ("placeholder", "get_attr"):
            if _seed(gm, node):
                carry.add(node)
        elif node.op != "output" and enabled and node.target not in _STOPS \
                and _floating(node) and any(a in carry for a in node.all_input_nodes):
            carry.add(node)
            if _in_place(node):
                carry.add(node.args[0])
    return carry


def backward_nodes(gm: fx.GraphModule, carry: set[fx.Node] | None = None) -> set[fx.Node]:
    """The nodes a backward from every floating output passes through: of ``carry`` (the
    values that require grad; by default as the graph's own tensors say; a ``detach`` never),
    those whose gradient comes back from an output."""
    carry = _carrying(gm) if carry is None else {n for n in carry if n.target not in _STOPS}
    output = next(iter(gm.graph.find_nodes(op="output")))
    reached = {n for n in output.all_input_nodes if n in carry}
    nodes = list(gm.graph.nodes)
    while True:  # an in-place write is reached through the tensor it wrote, read later
        before = len(reached)
        for node in reversed(nodes):
            if node in carry and node not in reached and (
                    any(u in reached for u in node.users)
                    or (_in_place(node) and node.args[0] in reached)):
                reached.add(node)
        if len(reached) == before:
            return reached
