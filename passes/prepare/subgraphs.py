"""Put a traced subgraph into a graph in place of the one call it stands for.

The shared step of the passes that inline: ``decompose_unruled`` (an op's traced
decomposition) and ``inline_autocast`` (an autocast scope's body). Constants of the subgraph
move onto the graph module under names the caller chooses; multi-output calls, read through
``getitem``, are replaced output by output.
"""

from __future__ import annotations

from typing import Callable

from torch import fx

__all__ = ["copy_subgraph", "replace_call"]


def copy_subgraph(gm: fx.GraphModule, sub: fx.GraphModule, args,
                  constant_name: Callable[[str], str]) -> tuple[object, list[fx.Node]]:
    """Copy ``sub``'s nodes into ``gm`` at its insertion point, ``sub``'s placeholders bound
    to ``args`` in order; each ``get_attr`` constant is set on ``gm`` as
    ``constant_name(target)``. Returns what ``sub``'s output maps to, and the copied nodes."""
    env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], args))
    copies = []
    for inner in sub.graph.nodes:
        if inner.op == "placeholder":
            continue
        if inner.op == "output":
            return fx.map_arg(inner.args[0], env.__getitem__), copies
        copy = gm.graph.node_copy(inner, env.__getitem__)
        if inner.op == "get_attr":
            copy.target = constant_name(inner.target)
            setattr(gm, copy.target, getattr(sub, inner.target))
        env[inner] = copy
        copies.append(copy)
    raise ValueError(f"subgraph {type(sub).__name__} has no output node")


def replace_call(gm: fx.GraphModule, call: fx.Node, result) -> None:
    """``call``'s uses read ``result`` (a tuple: its ``getitem`` users read their item);
    ``call`` is erased."""
    if isinstance(result, (list, tuple)):
        for user in list(call.users):
            user.replace_all_uses_with(result[user.args[1]])
            gm.graph.erase_node(user)
    else:
        call.replace_all_uses_with(result)
    gm.graph.erase_node(call)
