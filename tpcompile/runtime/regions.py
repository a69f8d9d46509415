"""Repeated blocks of a rewritten graph as one shared region, so torch.compile compiles them once.

``torch.export`` flattens a model into one graph: a 32-layer Llama is 32 copies of the same
block's nodes, and Dynamo, AOT autograd and inductor each walk every copy (compile time grows
with depth). :func:`regional_graph` outlines the identical copies into calls of one function
marked with ``torch.compiler.nested_compile_region``: Dynamo traces it once as an
``invoke_subgraph`` and stamps out the other calls, AOT autograd and inductor compile one body.

A *region* here is one call of a repeated block, outlined: the outermost block whose call a
node runs in (:func:`~tpcompile.core.block_paths.block_of`), counting only the items of a
module list (their paths end in an index) whose class the graph calls at two or more such
paths (``layers.0``, ``layers.1``, ... of ``LlamaBlock``). Nodes the rewrite inserted
(collectives) carry no stack and join the region of their first input. Two regions share
one body when their nodes, in order, have the same ops, targets, constant arguments, wiring
and tensor metadata; every value from outside (parameters, activations, sizes) becomes an
argument, so the weights of block i are inputs of the shared body rather than constants of
it. A region that is not a contiguous
run of nodes, or has no twin, stays inline: the result is always the same computation.

The flat graph stays :attr:`TPModule.graph_module` (what eager calls and the inspection tools
run and read); the regional graph is what a compiled TPModule runs with ``compile_regions``.
"""

from __future__ import annotations

import operator
from collections import Counter, defaultdict

import torch
from torch import fx

from tpcompile.core.block_paths import block_of

__all__ = ["regional_graph", "region_of_nodes"]


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """``[(module path, class name), ...]`` outermost first, from export's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, cls in stack.values():
        out.append((path, cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))))
    return out


def region_of_nodes(graph: fx.Graph) -> dict[fx.Node, str]:
    """The region (module path) of every node that belongs to one; see the module docstring."""
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
            region = block_of(node, blocks, called=True)
        else:  # inserted by the rewrite: the region of its first input
            region = next((out[a] for a in node.all_input_nodes if a in out), None)
        if region is not None:
            out[node] = region
    return out


def _runs(graph: fx.Graph, region_of: dict[fx.Node, str]) -> dict[str, list[fx.Node]]:
    """Region -> its nodes, for regions that are one contiguous run of the graph's nodes."""
    runs: dict[str, list[fx.Node]] = defaultdict(list)
    broken, last = set(), None
    for node in graph.nodes:
        region = region_of.get(node)
        if region is not None and runs[region] and last != region:
            broken.add(region)  # the region resumes after other nodes: not one run
        if region is not None:
            runs[region].append(node)
        last = region
    return {r: nodes for r, nodes in runs.items() if r not in broken}


def _meta_key(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return ("t", tuple(map(str, val.shape)), str(val.dtype), tuple(map(str, val.stride())))
    return ("v", type(val).__name__, str(val) if isinstance(val, (int, float, bool)) else "")


class _Region:
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
        """The region as a graph of its inputs, returning its outputs."""
        graph = fx.Graph()
        env = {a: graph.placeholder(f"arg{i}") for i, a in enumerate(self.inputs)}
        for node in self.nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[n] for n in self.outputs))
        return fx.GraphModule(torch.nn.Module(), graph, class_name="RegionBody")


def _shared_call(body: fx.GraphModule):
    """One function per body: Dynamo reuses a nested compile region by the function called."""

    marked = torch.compiler.nested_compile_region(lambda *args: body(*args))

    def region(*args):  # a plain function: FX's code generator refers to it as a global
        return marked(*args)

    return region


def regional_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """``gm`` with each set of identical regions outlined into calls of one shared body.

    Returns the new module (sharing ``gm``'s submodules, parameters and buffers, so it sees
    what ``gm`` sees) and the number of region calls; ``(gm, 0)`` when nothing repeats.
    """
    regions = [_Region(nodes) for nodes in _runs(gm.graph, region_of_nodes(gm.graph)).values()]
    twins = Counter(r.key for r in regions)
    regions = [r for r in regions if twins[r.key] >= 2]
    if not regions:
        return gm, 0
    calls = {}
    starts = {r.nodes[0]: r for r in regions}
    skipped = {n for r in regions for n in r.nodes}
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        region = starts.get(node)
        if region is not None:
            fn = calls.get(region.key)
            if fn is None:
                fn = calls[region.key] = _shared_call(region.body())
            out = graph.call_function(fn, tuple(env[a] for a in region.inputs))
            for i, n in enumerate(region.outputs):
                env[n] = graph.call_function(operator.getitem, (out, i))
                env[n].meta = dict(n.meta)
        elif node not in skipped:
            env[node] = graph.node_copy(node, env.__getitem__)
    regional = fx.GraphModule(gm, graph, class_name="RegionalGraph")
    _share_state(regional, gm)
    return regional, len(regions)


def _share_state(regional: fx.GraphModule, gm: fx.GraphModule) -> None:
    """Resolve ``regional``'s attributes through ``gm``'s own objects (one set of tensors)."""
    regional.__dict__["_parameters"] = gm._parameters
    regional.__dict__["_buffers"] = gm._buffers
    regional._modules.update(gm._modules)
