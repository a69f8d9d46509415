"""Tensor-subclass weights (torchao's quantized tensors) as the plain tensors they hold.

``torch.export`` keeps a subclass parameter (torchao's ``Int8Tensor``) as one ``get_attr``
and reads its parts through ``export.access_subclass_inner_tensor(weight, "qdata")``. The
planner cannot cut such a weight: it reports the outer dtype (float32), and the ops that open
it have no rule. Each part is a plain tensor, though, and the graph after the access is plain
ATen (a cast, a matmul, a multiply by scales): stored as a buffer of its own, each part is
planned like any other tensor (an int8 ``qdata`` is a quantized weight:
:mod:`tpcompile.passes.planner.rules.quantized`).
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["unwrap_subclass_weights", "subclass_part", "subclass_parts", "meta_like"]


def _access_op():
    export_ops = getattr(torch.ops, "export", None)
    return getattr(getattr(export_ops, "access_subclass_inner_tensor", None), "default", None)


def unwrap_subclass_weights(gm: fx.GraphModule) -> list[str]:
    """Replace every subclass weight that only ``access_subclass_inner_tensor`` reads by a
    buffer per part it reads, beside it (``weight`` -> ``weight_qdata``, ``weight_scale``).
    Returns a note for the capture when it replaced any: the sharded module's state names
    the parts, not the subclass weights."""
    access = _access_op()
    out: dict[str, str] = {}
    if access is None:
        return []
    for node in list(gm.graph.find_nodes(op="get_attr")):
        users = list(node.users)
        if not users or any(u.target is not access for u in users):
            continue
        owner_path, _, leaf = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        outer = getattr(owner, leaf)
        for user in users:
            part = user.args[1]
            name = f"{leaf}_{part}"
            owner.register_buffer(name, getattr(outer, part).detach())
            target = f"{owner_path}.{name}" if owner_path else name
            with gm.graph.inserting_before(user):
                plain = gm.graph.get_attr(target)
            plain.meta = dict(user.meta)
            user.replace_all_uses_with(plain)
            gm.graph.erase_node(user)
            out[target] = node.target
        gm.graph.erase_node(node)
        if leaf in owner._parameters:
            del owner._parameters[leaf]
        else:
            delattr(owner, leaf)
    if not out:
        return []
    gm.recompile()
    first = min(out)
    return [f"tensor-subclass weights ({out[first]}, ...) are stored as their parts ({first}, "
            "...): the sharded module's state names the parts"]


def subclass_part(model: nn.Module, target: str) -> torch.Tensor | None:
    """The part :func:`unwrap_subclass_weights` stores at ``target`` (``...weight_qdata``),
    read from ``model``'s subclass weight; None when ``target`` names no such part."""
    owner_path, _, leaf = target.rpartition(".")
    try:
        owner = model.get_submodule(owner_path) if owner_path else model
    except AttributeError:
        return None
    for name, t in list(owner.named_parameters(recurse=False)) + list(owner.named_buffers(recurse=False)):
        if leaf.startswith(f"{name}_") and is_traceable_wrapper_subclass(t):
            part = leaf[len(name) + 1:]
            if part in t.__tensor_flatten__()[0]:
                return getattr(t, part).detach()
    return None


def subclass_parts(model: nn.Module, gm: fx.GraphModule) -> frozenset[str]:
    """The get_attr targets of ``gm`` that are parts of ``model``'s subclass weights: what a
    quantized weight stores (its data, scales and zero points), counted as weight bytes
    whether or not the planner sees a dequantization behind them."""
    return frozenset(n.target for n in gm.graph.find_nodes(op="get_attr")
                     if subclass_part(model, n.target) is not None)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the meta device, a Parameter if ``t`` is one. A tensor subclass (torchao's
    ``Int8Tensor``, which implements no ``empty_like``) is rebuilt from meta copies of its
    parts, so a meta skeleton of a quantized model captures the graph the model does."""
    if is_traceable_wrapper_subclass(t):
        names, ctx = t.__tensor_flatten__()
        parts = {n: meta_like(getattr(t, n)) for n in names}
        meta = type(t).__tensor_unflatten__(parts, ctx, t.size(), t.stride())
    else:
        meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
