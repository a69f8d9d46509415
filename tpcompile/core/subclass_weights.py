"""Tensor-subclass weights (torchao's quantized tensors) as the plain tensors they hold.

``torch.export`` keeps a subclass parameter (torchao's ``Int8Tensor``) as one ``get_attr``
and reads its parts through ``export.access_subclass_inner_tensor(weight, "qdata")``. The
planner cannot cut such a weight: it reports the outer dtype (float32), and the ops that open
it have no rule. Each part is a plain tensor, though, and the graph after the access is plain
ATen (a cast, a matmul, a multiply by scales): stored as a buffer of its own, each part is
planned like any other tensor (an int8 ``qdata`` is a quantized weight:
:mod:`tpcompile.passes.planner.quantized`).
"""

from __future__ import annotations

import torch
from torch import fx, nn

__all__ = ["unwrap_subclass_weights"]


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
    weights = sorted(set(out.values()))
    return [f"{len(weights)} tensor-subclass weight(s) ({weights[0]}, ...) are stored as their "
            f"parts ({', '.join(sorted(out)[:2])}, ...): the sharded module's state names the parts"]
