"""Drop the work of experts another rank holds whole (looped experts under ``experts="expert"``).

A looped expert handed whole to one rank (``passes/planner/experts/looped.py``) is stored on
every other rank as 0-row placeholders. There its row-parallel product, a summand of the
block's partial sum, multiplies an empty dim: it is zeros. This pass removes what only
computes that zero summand: from each such matmul, the zeros are followed through products
and views to where they are added (``a + 0``, ``index_add(acc, d, idx, 0)``, and litgpt's
``index_put(acc, idx, acc[idx] + 0)``), each addition is replaced by its other operand, and
the ops left unread (the expert's token gather, its matmuls, its routing weights) are
removed. The rank then runs only its own experts; the partial sum and its one all-reduce are
unchanged. The placeholders stay in the graph's parameters (``state_dict`` and optimizers
see every expert), with no gradient on the ranks that do not run them.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from tpcompile.core.placement import Partial
from tpcompile.core.plan import ShardingPlan
from tpcompile.passes.planner.rules import is_param_matmul
from tpcompile.passes.planner.rules.table import is_view

__all__ = ["drop_unowned_experts_pass"]

aten = torch.ops.aten
_PRODUCTS = {aten.mul.Tensor}  # zero when any operand is
_SUMS = {aten.add.Tensor, aten.add_.Tensor}


def drop_unowned_experts_pass(gm: fx.GraphModule, plan: ShardingPlan, rank: int) -> PassResult:
    """Remove the work of experts held by other ranks from rank ``rank``'s graph."""
    empty = {name for name, e in plan.params.items()
             if e.style == "expert" and 0 in e.local_shapes[rank]}
    if not empty:
        return PassResult(gm, False)
    zeros: set[fx.Node] = set()
    replaced: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if _zero(node, zeros, empty, plan):
            zeros.add(node)
            continue
        kept = _without_zeros(node, zeros)
        if kept is not None:
            node.replace_all_uses_with(kept)
            replaced.add(node)
    if replaced:
        _drop_unread(gm.graph, replaced)
    return PassResult(gm, bool(replaced))


def _zero(node: fx.Node, zeros: set, empty: set, plan: ShardingPlan) -> bool:
    """``node`` is all zeros on this rank: a partial matmul product over a parameter stored
    empty here, or a product or view of such zeros."""
    if is_param_matmul(node):
        reads_empty = any(a.op == "get_attr" and a.target in empty for a in node.all_input_nodes)
        return reads_empty and isinstance(plan.placement(node.name), Partial)
    if node.target in _PRODUCTS:
        return any(a in zeros for a in node.all_input_nodes)
    return is_view(node) and node.args[0] in zeros


def _without_zeros(node: fx.Node, zeros: set) -> fx.Node | None:
    """What ``node`` equals once a zero summand is left out (None if it adds none): the
    other operand of a sum, the accumulator of an ``index_add``, the tensor an ``index_put``
    writes its own rows back into."""
    args = node.args
    if node.target in _SUMS and len(args) == 2 and not node.kwargs:
        a, b = args
        other = a if b in zeros else b if a in zeros else None
        if isinstance(other, fx.Node) and _same_shape(other, node):
            return other
    if node.target is aten.index_add.default and args[3] in zeros:
        return args[0]
    if node.target is aten.index_put.default and _reads_back(args[0], args[1], args[2]):
        return args[0]
    return None


def _reads_back(acc: fx.Node, indices, value) -> bool:
    """``value`` is ``acc[indices]``: writing it back leaves ``acc`` as it is."""
    return (isinstance(value, fx.Node) and value.target is aten.index.Tensor
            and value.args[0] is acc and list(value.args[1]) == list(indices))


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape


def _drop_unread(graph: fx.Graph, replaced: set) -> None:
    """Remove the function calls nothing reads: pure ones, and the replaced sums (an ``add_``
    into a gather nothing else reads). Parameters and other impure ops stay."""
    for node in reversed(list(graph.nodes)):
        if (node.op == "call_function" and not node.users
                and (node in replaced or not node.is_impure())):
            graph.erase_node(node)
