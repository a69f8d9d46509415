"""Weight-only quantized weights: integer tensors a matmul reads through their dequantization.

gpt-fast's int8 linear reads ``weight.to(x.dtype)``; a group-wise int4 one unpacks nibbles
with shifts and masks, stacks them, casts and applies ``(w - 8) * scale + zero`` per group of
the input dim before the matmul. Either way the matmul's weight operand is computed from
stored tensors alone (no activation reaches it), and one of them is an integer (or float8) tensor: the
*quantized weight*. The planner treats it as the parameter behind that operand
(``OpView.param_behind``), so the matmul starts a column-parallel root or joins a
row-parallel one exactly as a float weight would; the root is named by the quantized weight.
How the stored tensors are then cut: :mod:`tpcompile.passes.planner.absorb_dequantized`.

These are facts of the graph, not a step of the planner: which stored tensor is quantized
and which matmul reads it dequantized, asked by the rules' users (propagation, freeze, the
cut step, ``explain`` and Megatron's bound) the way they ask the table's ``is_param_matmul``.
So the module lives beside the rule table; it registers no rule.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.passes.planner.dims import val
from tpcompile.passes.planner.rules.table import is_param_matmul, is_view

__all__ = ["is_quantized_storage", "stored_behind", "stored_inputs", "dequantized_weight", "dequantized_readers", "quantized_weights",
           "undequantized_reason", "weight_targets"]

# a dequantization is a short computation: the search behind a matmul operand gives up past
# this many nodes (an activation's history is the whole graph)
MAX_NODES = 32


def stored_inputs(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(the get_attr tensors ``node`` is computed from, the nodes computing it from them,
    inputs before users), or None when an input reaches it or the computation is longer than
    ``MAX_NODES``."""
    leaves, inner, seen = [], [], set()

    def visit(n: fx.Node) -> bool:  # post-order: a node after everything it reads
        if n in seen:
            return True
        seen.add(n)
        if len(seen) > MAX_NODES or n.op == "placeholder":
            return False
        if n.op == "get_attr":
            leaves.append(n)
            return True
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        inner.append(n)
        return True

    return (leaves, inner) if visit(node) else None


def is_quantized_storage(node: fx.Node) -> bool:
    """An integer tensor, or a one-byte float (torchao's float8 ``qdata``): storage no matmul
    reads as it is."""
    v = val(node)
    if not isinstance(v, torch.Tensor) or v.is_complex():
        return False
    return not v.is_floating_point() or v.element_size() == 1


def stored_behind(node: fx.Node) -> fx.Node | None:
    """The quantized storage ``node`` is, or is a view of (``qdata.t()``): the weight of an
    integer matmul that reads it as stored (dynamic activation quantization; the bias its
    zero-point trick needs sums the same view, so the view may have two users); else None."""
    while is_view(node):
        node = node.args[0]
    return node if node.op == "get_attr" and is_quantized_storage(node) else None


def dequantized_weight(node: fx.Node) -> fx.Node | None:
    """The quantized weight a floating ``node`` dequantizes: the largest integer (or float8)
    get_attr it is computed from when only stored tensors reach it; else None."""
    v = val(node)
    if (node.op == "get_attr" or not isinstance(v, torch.Tensor)
            or not v.is_floating_point() or v.element_size() == 1):
        return None
    found = stored_inputs(node)
    if found is None:
        return None
    ints = [leaf for leaf in found[0] if is_quantized_storage(leaf)]
    return max(ints, key=lambda n: val(n).numel()) if ints else None


def dequantized_readers(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Stored tensor a matmul operand is dequantized from (a quantized weight, its scales and
    zeros) -> that matmul: the op whose placement says if the tensor's cut is column- or
    row-parallel."""
    out: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if not is_param_matmul(node):
            continue
        for arg in node.all_input_nodes:
            if dequantized_weight(arg) is not None:
                out.update((leaf, node) for leaf in stored_inputs(arg)[0])
    return out


def quantized_weights(gm: fx.GraphModule) -> frozenset[str]:
    """Targets of the tensors weight-only quantization stores for a matmul's weight (integer
    weights, the scales and zeros their dequantization reads before the matmul)."""
    return frozenset(leaf.target for leaf in dequantized_readers(gm))


def undequantized_reason(node: fx.Node) -> str:
    """Why a stored part of a tensor-subclass weight that no dequantization reads is kept
    whole, naming the op that reads it (past its views)."""
    seen = [node]
    for n in seen:  # breadth first past views (a transposed weight read twice)
        for u in n.users:
            if is_view(u):
                seen.append(u)
            elif val(u) is not None:
                return (f"part of a tensor-subclass weight that {u.name} ({u.target}) reads as "
                        "stored, not dequantized to a float matmul weight (dynamic activation "
                        "quantization: an integer matmul of activations quantized per token "
                        "over their whole row, which a cut of that row would change): kept "
                        "whole, its matmul runs replicated")
    return "part of a tensor-subclass weight that no op reads"


def weight_targets(cap) -> frozenset[str]:
    """What the parameter bytes of a report count: parameters, the tensors weight-only
    quantization stores for a matmul's weight, and every part of a tensor-subclass weight
    (torchao's int8 / intx / float8 data, scales and zero points, dequantized or not)."""
    return cap.params | quantized_weights(cap.gm) | cap.subclass_parts
