"""Which forward collectives run again in backward, when a checkpointed region is recomputed.

``parallelize`` runs each activation-checkpointed region through
``torch.utils.checkpoint(..., use_reentrant=False)`` (passes/rewrite/checkpoint_regions.py).
Under full recomputation (``activation_checkpointing="full"``, or the model's own
``checkpoint`` calls) backward runs the region's ops again, collectives included, and torch
stops as soon as every tensor the region saved for backward is made again (its default early
stop). So a forward collective is issued a second time, in backward, exactly when an op after
it in the region saves a tensor: Llama's attention all-reduce (the MLP's norm and matmuls
follow it) is, the MLP's closing all-reduce (only the residual add follows) is not.
``"selective"`` saves every collective's output and recomputes none.

An op saves a tensor unless it is outside autograd (no gradient through it,
:func:`~tpcompile.runtime.backward_reach.backward_nodes`) or one of :data:`PASS_THROUGH`, ops
whose backward needs no saved value (adds, views, concatenations, the collectives).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from tpcompile.passes.rewrite.checkpoint_regions import outlinable_regions
from tpcompile.runtime.backward_reach import backward_nodes
from tpcompile.runtime.collectives import COLLECTIVE_FNS, gathered_linears
from tpcompile.runtime.vocab import vocab_parallel_cross_entropy

__all__ = ["recomputed_calls", "PASS_THROUGH"]

_A = torch.ops.aten
# ops whose backward reads no tensor saved in forward (it needs at most sizes)
PASS_THROUGH = {
    _A.add.Tensor, _A.sub.Tensor, _A.neg.default, _A.view.default, _A._unsafe_view.default,
    _A.reshape.default, _A.transpose.int, _A.t.default, _A.permute.default, _A.expand.default,
    _A.unsqueeze.default, _A.squeeze.dim, _A.squeeze.default, _A.slice.Tensor, _A.select.int,
    _A.split.Tensor, _A.split_with_sizes.default, _A.chunk.default, _A.unbind.int,
    _A.cat.default, _A.stack.default, _A.clone.default, _A.contiguous.default,
    _A.alias.default, _A.flatten.using_ints, _A.unflatten.int, _A.view_as.default,
    _A.movedim.int, _A.narrow.default, _A._to_copy.default, _A.to.dtype, operator.getitem,
    torch.ops._c10d_functional.wait_tensor.default,
}

# inserted calls whose Functions save tensors (the gathered input and weights, the softmax)
_SAVING_CALLS = {gathered_linears, vocab_parallel_cross_entropy}


def _identity_dropout(node: fx.Node) -> bool:
    """``dropout(x, p, train)`` with ``p == 0`` or outside training returns ``x``: no mask."""
    return node.target is _A.dropout.default and (node.args[1] == 0 or not node.args[2])


def _saves(node: fx.Node, in_backward: set) -> bool:
    if node not in in_backward or node.target in PASS_THROUGH or _identity_dropout(node):
        return False
    if node.target in COLLECTIVE_FNS:  # most keep sizes and groups only, no tensor
        return node.target in _SAVING_CALLS
    return True


def recomputed_calls(gm: fx.GraphModule, mode: str | None) -> set[fx.Node]:
    """The inserted collective calls of ``gm`` whose forward collectives a checkpointed
    region's recomputation issues again in backward (none under ``"selective"``)."""
    if mode == "selective":
        return set()
    regions, _ = outlinable_regions(gm, mode)
    in_backward, out = backward_nodes(gm), set()
    for region in regions:
        saving_after = False
        for node in reversed(region.nodes):
            if node.target in COLLECTIVE_FNS and COLLECTIVE_FNS[node.target][0] and saving_after:
                out.add(node)
            saving_after = saving_after or _saves(node, in_backward)
    return out
