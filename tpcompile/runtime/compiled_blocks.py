"""Repeated blocks of a rewritten graph as calls of one compiled block, so they compile once.

``torch.export`` flattens a model into one graph: a 32-layer Llama is 32 copies of the same
block's nodes, and Dynamo, AOT autograd and inductor each walk every copy (compile time grows
with depth). :func:`compiled_blocks_graph` outlines the identical copies into calls of one
function marked with ``torch.compiler.nested_compile_region``: Dynamo traces it once as an
``invoke_subgraph`` and stamps out the other calls, AOT autograd and inductor compile one body.

A *compiled block* is one call of a repeated block, outlined: the outermost block whose call a
node runs in (:func:`~tpcompile.core.block_paths.block_of`), counting only the items of a
module list (their paths end in an index) whose class the graph calls at two or more such
paths (``layers.0``, ``layers.1``, ... of ``LlamaBlock``). Nodes the rewrite inserted
(collectives) carry no stack and join the block of their first input. Two blocks share
one body when their nodes, in order, have the same ops, targets, constant arguments, wiring
and tensor metadata; every value from outside (parameters, activations, sizes) becomes an
argument, so the weights of block i are inputs of the shared body rather than constants of
it. A block that is not a contiguous
run of nodes, or has no twin, stays inline: the result is always the same computation.

The flat graph stays :attr:`TPModule.graph_module` (what eager calls and the inspection tools
run and read); the outlined graph is what a compiled TPModule runs with ``compiled_blocks``.
"""

from __future__ import annotations

import operator
from collections import Counter, defaultdict

import torch
from torch import fx

from tpcompile.core.block_paths import block_of

__all__ = ["compiled_blocks_graph", "compiled_block_of_nodes"]


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """``[(module path, class name), ...]`` outermost first, from export's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, cls in stack.values():
        out.append((path, cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))))
    return out


def compiled_block_of_nodes(graph: fx.Graph) -> dict[fx.Node, str]:
    """The compiled block (module path) of every node that belongs to one (module docstring)."""
    paths_of = defaultdict(set)
    for node in graph.nodes:
        for path, cls in _stack(node):
            if path.rpartition(".")[2].isdigit():  # an item of a ModuleList / Sequential
                paths_of[cls].add(path)
    blocks = {p for paths in paths_of.values() if len(paths) >= 2 for p in paths}
    out: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if _stack(node):
            block = block_of(node, blocks, called=True)
        else:  # inserted by the rewrite: the block of its first input
            block = next((out[a] for a in node.all_input_nodes if a in out), None)
        if block is not None:
            out[node] = block
    return out


def _runs(graph: fx.Graph, block_of_node: dict[fx.Node, str]) -> dict[str, list[fx.Node]]:
    """Block -> its nodes, for blocks that are one contiguous run of the graph's nodes."""
    runs: dict[str, list[fx.Node]] = defaultdict(list)
    broken, last = set(), None
    for node in graph.nodes:
        block = block_of_node.get(node)
        if block is not None and runs[block] and last != block:
            broken.add(block)  # the block resumes after other nodes: not one run
        if block is not None:
            runs[block].append(node)
        last = block
    return {r: nodes for r, nodes in runs.items() if r not in broken}


def _meta_key(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return ("t", tuple(map(str, val.shape)), str(val.dtype), tuple(map(str, val.stride())))
    return ("v", type(val).__name__, str(val) if isinstance(val, (int, float, bool)) else "")


class _BlockRun:
    """One run of nodes: its inputs (from outside), outputs (used outside) and structure key."""

    def __init__(self, nodes: list[fx.Node]):
        self.nodes = nodes
        inside = set(nodes)
        self.inputs: list[fx.Node] = []
        for node in nodes:
            for a in node.all_input_nodes:
                if a not in inside and a not in self.inputs:
                    self.inputs.append(a)
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        local = {a: ("in", i) for i, a in enumerate(self.inputs)}
        local.update({n: ("n", i) for i, n in enumerate(nodes)})

        def arg(a):
            return local[a] if isinstance(a, fx.Node) else a

        self.key = (tuple(_meta_key(a) for a in self.inputs),
                    tuple((n.op, n.target, repr(fx.node.map_aggregate(n.args, arg)),
                           repr(fx.node.map_aggregate(n.kwargs, arg)), _meta_key(n))
                          for n in nodes),
                    tuple(local[n] for n in self.outputs))

    def body(self) -> fx.GraphModule:
        """The block as a graph of its inputs, returning its outputs."""
        graph = fx.Graph()
        env = {a: graph.placeholder(f"arg{i}") for i, a in enumerate(self.inputs)}
        for node in self.nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[n] for n in self.outputs))
        return fx.GraphModule(torch.nn.Module(), graph, class_name="CompiledBlockBody")


def _shared_call(body: fx.GraphModule):
    """One function per body: Dynamo reuses a nested compile region by the function called."""

    marked = torch.compiler.nested_compile_region(lambda *args: body(*args))

    def compiled_block(*args):  # a plain function: FX's code generator refers to it as a global
        return marked(*args)

    return compiled_block


def compiled_blocks_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """``gm`` with each set of identical blocks outlined into calls of one shared body.

    Returns the new module (sharing ``gm``'s submodules, parameters and buffers, so it sees
    what ``gm`` sees) and the number of block calls; ``(gm, 0)`` when nothing repeats.
    """
    runs = [_BlockRun(nodes)
            for nodes in _runs(gm.graph, compiled_block_of_nodes(gm.graph)).values()]
    twins = Counter(r.key for r in runs)
    runs = [r for r in runs if twins[r.key] >= 2]
    if not runs:
        return gm, 0
    calls = {}
    starts = {r.nodes[0]: r for r in runs}
    skipped = {n for r in runs for n in r.nodes}
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        run = starts.get(node)
        if run is not None:
            fn = calls.get(run.key)
            if fn is None:
                fn = calls[run.key] = _shared_call(run.body())
            out = graph.call_function(fn, tuple(env[a] for a in run.inputs))
            for i, n in enumerate(run.outputs):
                env[n] = graph.call_function(operator.getitem, (out, i))
                env[n].meta = dict(n.meta)
        elif node not in skipped:
            env[node] = graph.node_copy(node, env.__getitem__)
    outlined = fx.GraphModule(gm, graph, class_name="CompiledBlocksGraph")
    _share_state(outlined, gm)
    return outlined, len(runs)


def _share_state(outlined: fx.GraphModule, gm: fx.GraphModule) -> None:
    """Resolve ``outlined``'s attributes through ``gm``'s own objects (one set of tensors)."""
    outlined.__dict__["_parameters"] = gm._parameters
    outlined.__dict__["_buffers"] = gm._buffers
    outlined._modules.update(gm._modules)
