"""Give a parallelized model's repeated blocks their own ``forward`` again (for FSDP2).

``parallelize`` returns one flat graph: a block's parameters are read by ``get_attr`` nodes and
its submodule is never *called*. Engines that work through module calls need the calls back:
FSDP2's ``fully_shard(block)`` gathers a block's parameters in the block's forward pre-hook
and frees them after it, which is how torchtitan bounds a rank's memory to one unsharded
block at a time. :func:`outline_blocks` cuts each block's run of nodes out of the rewritten
graph into a GraphModule installed at the block's own path (``layers.0``), and calls it from
the root graph. Parameter names, values, the collectives and their order are unchanged, so
the plan, checkpoints and optimizer state are exactly those of the flat module.

A node belongs to a block when its ``nn_module_stack`` (kept by torch.export) names a module
inside the block; a node the rewrite inserted (a collective, with no stack) belongs to the
block its neighbours on both sides belong to. A block's nodes must form one contiguous run of
the graph: otherwise it is reported, never reordered. An activation-checkpointed region
(``parallelize(..., activation_checkpointing=...)`` or the model's own checkpoint calls) is one
call in the graph and belongs to the block its ops ran in, so it runs, recomputation included,
inside the block's forward; FSDP2 gathers the block's parameters again before the backward
that recomputes it.
"""

from __future__ import annotations

import operator

from torch import fx, nn

from tpcompile.core.block_paths import block_of, repeated_block_paths
from tpcompile.errors import TPCompileError

__all__ = ["outline_blocks", "fully_shard_blocks", "repeated_block_paths"]


def _owner(node: fx.Node, paths: list[str]) -> str | None:
    """The block ``node`` runs in; a checkpointed region's call (its target carries the
    region's ``body``, :mod:`passes.rewrite.checkpoint_regions`) runs in the one block all of
    its ops run in, and belongs to none when they span several."""
    body = getattr(node.target, "body", None)
    if not isinstance(body, fx.GraphModule):
        return block_of(node, paths)
    owners = {block_of(n, paths) for n in body.graph.nodes if n.op == "call_function"}
    owners.discard(None)
    return owners.pop() if len(owners) == 1 else None


def _runs(graph: fx.Graph, paths: list[str]) -> dict[str, list[fx.Node]]:
    """block path -> its nodes in graph order (computations only; get_attr handled apart).
    The graph's one ``call_module``, export's ``_guards_fn`` input check, stays in the root
    even where export gave it the first block's module stack (a model whose first op is in a
    block)."""
    compute = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    owner = [_owner(n, paths) for n in compute]
    for i, o in enumerate(owner):  # inserted nodes: the block around them
        if o is None:
            before = next((owner[j] for j in range(i - 1, -1, -1) if owner[j]), None)
            after = next((owner[j] for j in range(i + 1, len(owner)) if owner[j]), None)
            if before is not None and before == after:
                owner[i] = before
    runs: dict[str, list[fx.Node]] = {}
    for node, o in zip(compute, owner):
        if o is not None:
            runs.setdefault(o, []).append(node)
    position = {n: i for i, n in enumerate(compute)}
    for path, nodes in runs.items():
        if position[nodes[-1]] - position[nodes[0]] + 1 != len(nodes):
            inside = [n.name for n in compute[position[nodes[0]]:position[nodes[-1]]] if n not in nodes]
            raise TPCompileError(
                f"outline_blocks: the nodes of block {path!r} are interleaved with others "
                f"({inside[:3]}), so it cannot be called as one module")
    return runs


def _outline(gm: fx.GraphModule, path: str, run: list[fx.Node]) -> None:
    """Replace ``run`` in ``gm`` by a call of a GraphModule installed at ``path``."""
    prefix, members = path + ".", set(run)
    block_graph, env = fx.Graph(), {}
    inputs: list[fx.Node] = []

    def value(arg: fx.Node) -> fx.Node:
        if arg not in env:
            if arg.op == "get_attr" and arg.target.startswith(prefix):
                env[arg] = block_graph.get_attr(arg.target[len(prefix):])
            else:
                inputs.append(arg)
                env[arg] = block_graph.placeholder(arg.name)
            env[arg].meta = dict(arg.meta)
        return env[arg]

    for node in run:
        env[node] = block_graph.node_copy(node, value)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    block_graph.output(tuple(env[n] for n in outputs) if len(outputs) != 1 else env[outputs[0]])
    _hoist_inputs(block_graph)

    old = gm.get_submodule(path)
    block = fx.GraphModule(old, block_graph, class_name=type(old).__name__)
    block._modules.clear()
    block._modules.update(old._modules)  # the same submodules and tensors, under the same names
    block._parameters.update(old._parameters)
    block._buffers.update(old._buffers)
    block._non_persistent_buffers_set = set(old._non_persistent_buffers_set)
    parent, _, leaf = path.rpartition(".")
    setattr(gm.get_submodule(parent), leaf, block)

    with gm.graph.inserting_before(run[0]):
        call = gm.graph.call_module(path, tuple(inputs))
        results = [call] if len(outputs) == 1 else [
            gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for node, result in zip(outputs, results):
        node.replace_all_uses_with(result)
    for node in reversed(run):
        gm.graph.erase_node(node)
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        if node.target.startswith(prefix):
            gm.graph.erase_node(node)


def _hoist_inputs(graph: fx.Graph) -> None:
    """Move placeholders, then get_attrs, to the front (fx requires placeholders first)."""
    heads = [n for n in graph.nodes if n.op == "placeholder"] + \
            [n for n in graph.nodes if n.op == "get_attr"]
    anchor = next(n for n in graph.nodes if n not in set(heads))
    for node in heads:
        anchor.prepend(node)
    graph.lint()


def outline_blocks(tp: nn.Module, paths: list[str] | None = None) -> list[nn.Module]:
    """Make each block of ``tp`` (a :class:`~tpcompile.TPModule`) a called submodule.

    Args:
        tp: what ``parallelize`` returned; changed in place, before any ``fully_shard``.
        paths: the blocks' module paths (``["layers.0", "layers.1"]``); default: every child
            of a ``ModuleList`` (:func:`repeated_block_paths`).

    Returns:
        the block modules in order, ready for ``fully_shard(block, mesh=mesh["dp"])``.
    """
    gm = tp.graph_module
    paths = repeated_block_paths(gm) if paths is None else list(paths)
    if not paths:
        raise TPCompileError("outline_blocks: the model has no ModuleList of blocks; pass paths=")
    runs = _runs(gm.graph, paths)
    missing = [p for p in paths if p not in runs]
    if missing:
        raise TPCompileError(f"outline_blocks: no node of the graph runs in {missing}")
    for path in paths:
        _outline(gm, path, runs[path])
    gm.graph.lint()
    gm.recompile()
    return [gm.get_submodule(p) for p in paths]


def fully_shard_blocks(tp: nn.Module, dp_mesh, paths: list[str] | None = None, **fsdp_kwargs) -> nn.Module:
    """FSDP2 over ``dp_mesh`` around a tensor-parallel module, as torchtitan applies it.

    :func:`outline_blocks`, then ``fully_shard`` on each block and on the root (which takes
    the remaining tensors: embeddings, final norm, head), with ``fsdp_kwargs`` (``mp_policy``,
    ``reshard_after_forward``, ...). Returns ``tp``, now also an ``FSDPModule``.
    """
    from torch.distributed.fsdp import fully_shard

    for block in outline_blocks(tp, paths):
        fully_shard(block, mesh=dp_mesh, **fsdp_kwargs)
    return fully_shard(tp, mesh=dp_mesh, **fsdp_kwargs)
