"""Where a model's repeated blocks are, and which block a captured graph node runs in.

Shared by the capture that reuses one block's graph for every identical block
(:mod:`tpcompile.core.stamp`) and by ``outline_blocks`` (FSDP2 per block): both read the
``nn_module_stack`` torch.export records on every node.
"""

from __future__ import annotations

from torch import fx, nn

__all__ = ["repeated_block_paths", "block_of"]


def repeated_block_paths(module: nn.Module) -> list[str]:
    """Paths of the children of every container whose children are named 0, 1, 2, ...

    (``nn.ModuleList``, or its plain-module copy in an exported graph), outermost first.
    """
    paths = []
    for name, sub in module.named_modules():
        children = list(sub.named_children())
        if len(children) > 1 and all(c.isdigit() for c, _ in children):
            paths += [f"{name}.{c}" if name else c for c, _ in children]
    return paths


def block_of(node: fx.Node, paths: list[str]) -> str | None:
    """The block of ``paths`` whose module (or a submodule of it) ``node`` was traced in; for
    a parameter or buffer (``get_attr``), the block its name is under."""
    if node.op == "get_attr":
        names = [node.target]
    else:
        stack = node.meta.get("nn_module_stack") or {}
        names = [path for path, _ in reversed(list(stack.values()))]
    for path in names:
        for p in paths:
            if path == p or path.startswith(p + "."):
                return p
    return None
