"""One node order and one set of node names per computation, whatever order the model ran in.

Model code may loop over a set of strings: transformers builds one rotary embedding per
``set(config.layer_types)`` (Gemma 3 and 4, ModernBERT, Llama 4, Olmo 3, ...). Python orders
such a set by its per-process hash seed, so two ranks capture the same computation in two
orders, export numbers their nodes in two ways (``to_8`` is the sliding-window table on one
rank, the full one on the other), and the plan, keyed by node names, differs: ``parallelize``
stops with ``PlanMismatchError`` on some runs and not on others, and ``explain`` prints other
names from run to run.

Capture therefore makes the order a function of what the graph computes, not of the order it ran in:

- Nodes that mutate memory, draw random numbers or touch global state (*barriers*) keep their
  program order, and every other node stays between the same two barriers as before: a read
  of a buffer never moves across a write to it, nor dropout masks across each other. A node
  also stays within its run of the same repeated block (``layers.3``), so each block's nodes
  stay together and top-level code stays where it ran.
- Between two barriers, a node runs just before the first node that needs it, operands in
  argument order (demand order), the way one reads the code from its result backwards.
- Nodes nobody reads (export's metadata assertions, dead code) run right after their last
  operand.

Nodes are then named afresh in that order, as export names them (``view``, ``view_1``, ...);
placeholders and attribute reads keep their names and export's order (the model's own).
"""

from __future__ import annotations

import heapq
import operator
import re

import torch
from torch import fx

__all__ = ["canonical_order", "is_barrier"]

_PURE_MODULES = ("_operator", "math")  # SymInt arithmetic in dynamic graphs


def is_barrier(node: fx.Node) -> bool:
    """A call whose position among the others matters beyond its data dependencies."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
    if target is operator.getitem or getattr(target, "__module__", "").startswith(_PURE_MODULES):
        return False
    return True  # higher-order ops, grad-mode switches, anything unknown keeps its place


def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(dict.fromkeys(node.all_input_nodes))


def _demand_order(roots: list[fx.Node], span: set[fx.Node], placed: set[fx.Node]) -> list[fx.Node]:
    """Post-order of ``roots``' operands inside ``span`` (each root itself included)."""
    out: list[fx.Node] = []
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in placed:
                continue
            if expanded:
                placed.add(node)
                out.append(node)
                continue
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(_inputs(node)) if a in span and a not in placed)
    return out


def _scope(node: fx.Node) -> str:
    """The repeated block a node runs in (``layers.3`` of ``layers.3.attn.wq``), or ""."""
    stack = node.meta.get("nn_module_stack")
    path = next(reversed(stack.values()))[0] if stack else ""
    parts = path.split(".")
    cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts[:cut + 1]) if cut is not None else ""


def _spans(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """Runs of movable nodes: a barrier ends one, and so does a change of repeated block (a
    block's nodes stay together, as tools that cut the graph per block expect)."""
    spans: list[list[fx.Node]] = [[]]
    scope = None
    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if spans[-1] and _scope(node) != scope:
            spans.append([])
        scope = _scope(node)
        spans[-1].append(node)
        if is_barrier(node):
            spans.append([])
    return [span for span in spans if span] or [[]]


def _stable_topological(order: list[fx.Node], members: set[fx.Node]) -> list[fx.Node]:
    """``order`` itself where it is topological, else the nearest order that is."""
    rank = {n: i for i, n in enumerate(order)}
    waiting = {n: sum(a in members for a in _inputs(n)) for n in order}
    ready = [rank[n] for n in order if waiting[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        node = order[heapq.heappop(ready)]
        out.append(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, rank[user])
    return out


def _order_span(span: list[fx.Node], where: dict[fx.Node, tuple[int, int]], index: int,
                output: fx.Node) -> list[fx.Node]:
    members = set(span)
    barrier = span[-1] if span and is_barrier(span[-1]) else output
    # nodes read after the span, by where their first reader runs (later spans are ordered)
    later = {}
    for node in span:
        reads = [(where[u], _inputs(u).index(node)) for u in node.users if u in where]
        if reads:
            later[node] = min(reads)
    roots = [r for r in _inputs(barrier) + sorted(later, key=later.get) if r in members]
    placed: set[fx.Node] = {barrier}
    order = _demand_order(roots, members, placed)
    position = {n: i for i, n in enumerate(order)}

    def key(sink: fx.Node):  # where it attaches, then what it is (names are not canonical yet)
        operands = [position[a] for a in _inputs(sink) if a in position]
        shape = fx.map_arg((sink.args, sink.kwargs), lambda a: position.get(a, str(a.target)))
        return max(operands, default=-1), str(sink.target), str(shape)

    # nobody reads what is left: each unread node (and what only it reads) after its operands
    sinks = [n for n in span if n not in placed and not any(u in members for u in n.users)]
    after: dict[int, list[fx.Node]] = {}
    for sink in sorted(sinks, key=key):
        after.setdefault(key(sink)[0], []).extend(_demand_order([sink], members, placed))
    order = after.get(-1, []) + [m for i, n in enumerate(order) for m in [n, *after.get(i, [])]]
    order = _stable_topological(order, members - {barrier})
    if barrier is not output:
        order.append(barrier)
    for i, node in enumerate(order):
        where[node] = (index, i)
    return order


def canonical_order(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its graph in canonical order and names (capture runs it on every graph)."""
    nodes = list(gm.graph.nodes)
    # attribute reads and inputs keep export's order (the model's own, and nothing else's)
    placeholders = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    output = next(n for n in reversed(nodes) if n.op == "output")
    spans = _spans(nodes)
    where: dict[fx.Node, tuple[int, int]] = {output: (len(spans), 0)}
    ordered = [_order_span(span, where, i, output) for i, span in reversed(list(enumerate(spans)))]
    order = placeholders + [n for span in reversed(ordered) for n in span] + [output]
    assert len(order) == len(nodes), "canonical_order lost or repeated a node"

    graph = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        keep = node.op in ("placeholder", "get_attr", "output")
        name = node.name if keep else re.sub(r"_\d+$", "", node.name)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a])
        env[node] = graph.create_node(node.op, node.target, args, kwargs, name, node.type)
        env[node].meta = dict(node.meta)
    graph.lint()
    gm.graph = graph  # the setter regenerates gm's code
    return gm
