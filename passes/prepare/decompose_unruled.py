"""Ops the rule table does not know are planned through their decompositions.

The rule table covers the ops transformer code produces, but model code reaches further
(``torch.square`` in a ReLU² MLP, ``logsumexp`` in an attention sink, ``view_as``, ``pad``).
Rather than gather every sharded input of such an op, the planner first rewrites it into what
PyTorch itself lowers it to (``torch._decomp``'s core ATen decompositions, or the op's own
composite kernel): ``square(x)`` is ``x * x``, ``logsumexp`` an ``amax``, a ``sub``, an ``exp``
and a ``sum``, each of which the table knows. Only ops with no rule that met a sharded or
partial input are rewritten (every use of such an op: the next layer's is the next blocker),
and the trace stops at ops the table knows. A ruled op is rewritten only at the nodes whose
rule asked for it, through the rule's own ``decomposition`` (a vector norm over a sharded dim
becomes a mean of powers, planned as a per-token statistic).

The decomposition is traced with ``make_fx`` in the capture's own fake mode, so symbolic
batch and sequence sizes stay symbolic (``sym_size`` nodes of the operands), and inlined in
place of the node; each new node keeps the original's source line and module path. The pass
returns, beside the graph, which op each new node was decomposed from (its pass record's
``facts``); it writes no metadata key of its own.
"""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch._decomp import core_aten_decompositions
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpcompile.passes.planner.rules import rule_for, rule_for_target
from tpcompile.passes.prepare.subgraphs import copy_subgraph, replace_call

__all__ = ["decomposable", "decompose_nodes", "decompose_unruled_pass", "MAX_ROUNDS"]

MAX_ROUNDS = 4  # a decomposition may expose the next op without a rule

_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr")


@functools.cache
def _table() -> dict:
    return dict(core_aten_decompositions())


def _decomposition(target):
    if (rule := rule_for_target(target)) is not None:
        return rule.decomposition
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target in _table():
        return _table()[target]
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return target.decompose
    return None


def decomposable(node: fx.Node) -> bool:
    """An op with no rule that PyTorch can express in other ops, or one its rule decomposes."""
    return (node.op == "call_function" and _decomposition(node.target) is not None
            and not node.target._schema.is_mutable)


@functools.cache
def _unruled_table() -> dict:
    """Decompositions of the ops the rule table lacks: the trace stops at ops it knows."""
    return {op: fn for op, fn in _table().items() if rule_for_target(op) is None}


def _trace(node: fx.Node, table: dict) -> tuple[fx.GraphModule, list]:
    """The node's decomposition as a graph whose placeholders are the node's tensor and
    SymInt operands, in order: (graph, those operands)."""
    originals, spec = tree_flatten((node.args, node.kwargs))
    values = [a.meta["val"] if isinstance(a, fx.Node) else a for a in originals]
    traced = [i for i, v in enumerate(values) if isinstance(v, (torch.Tensor, torch.SymInt))]
    fn = _decomposition(node.target)

    def run(*operands):
        flat = list(values)
        for i, v in zip(traced, operands):
            flat[i] = v
        args, kwargs = tree_unflatten(flat, spec)
        return fn(*args, **kwargs)

    inputs = [values[i] for i in traced]
    with detect_fake_mode(inputs) or torch._subclasses.FakeTensorMode():
        gm = make_fx(run, tracing_mode="symbolic", decomposition_table=table)(*inputs)
    return gm, [originals[i] for i in traced]


def decompose_nodes(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[str, str]:
    """Replace each of ``nodes`` by its traced decomposition; returns each new node's name ->
    the op it was decomposed from."""
    if not nodes:
        return {}
    table = _unruled_table()
    made = {}
    for node in nodes:
        sub, operands = _trace(node, table)
        with gm.graph.inserting_before(node):
            result, copies = copy_subgraph(gm, sub, operands, lambda target: next(
                f"_decomposed_constant_{i}" for i in range(len(gm.graph.nodes) + 1)
                if not hasattr(gm, f"_decomposed_constant_{i}")))  # a constant it made
        for copy in copies:
            copy.meta.update({k: node.meta[k] for k in _KEPT_META if k in node.meta})
            made[copy.name] = str(node.target)
        replace_call(gm, node, result)
    return made


def decompose_unruled_pass(gm: fx.GraphModule,
                           no_rule: dict[fx.Node, str]) -> tuple[PassResult, dict[str, str]]:
    """logsumexp(x) -> amax, sub, exp, sum: ops with no rule that met sharded data, decomposed.

    ``no_rule``: the planner's ops with no rule that met a sharded or partial input. Every use
    of such an op is rewritten: the same op in the next layer is the next blocker.
    """
    ops = {n.target for n in no_rule if decomposable(n)}
    unruled = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops
               and (rule_for(n) is None or n in no_rule)]  # a ruled op: only where it asked
    return PassResult(gm, bool(unruled)), decompose_nodes(gm, unruled)
