"""Which blocks of a model's block list trace to the same graph, and with what period.

Capture reusing blocks (:mod:`tpcompile.core.stamp`) exports a few blocks and repeats one
block's graph for the others; that is sound only for blocks that are identical in structure:
the same module classes, parameter and buffer names, shapes and dtypes, the same plain
attributes, no hooks. Two things real models do are not differences:

- an integer attribute equal to the block's own index in every block (Hugging Face's
  ``layer_idx``: it names the block's cache entry), where ``forward`` only passes it to a call;
  the graphs of two exported blocks with different indices are also compared node for node
  before any block is repeated. A forward that branches or indexes on it is a difference: the
  exported blocks would not show what another index runs;
- a pattern that repeats: Gemma-2's sliding / full attention layers alternate (period 2),
  Gemma-3's five sliding layers and one full one (period 6). Blocks ``p .. 2p-1`` then form one
  *group* repeated with period ``p``, and the stamp repeats groups instead of blocks.

Block 0 may differ from the rest (it is exported either way).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn

__all__ = ["block_period", "not_identical"]


def _modules(block: nn.Module) -> list | None:
    """Per submodule: (name, class, plain attributes, tensors); None when a hook is set."""
    out = []
    for name, m in block.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
        tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad)
                   for n, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]
        out.append((name, type(m), plain, tensors))
    return out


def _index_attributes(raw: list[list]) -> set[tuple[str, str]]:
    """(submodule, attribute) pairs whose value is the block's index in every block and that
    the submodule's ``forward`` only passes on (:func:`_only_passed`)."""
    found = None
    for i, modules in enumerate(raw):
        here = {(name, k) for name, cls, plain, _ in modules for k, v in plain.items()
                if type(v) is int and v == i and _only_passed(cls, k)}
        found = here if found is None else found & here
    return found or set()


@functools.cache
def _only_passed(cls: type, attr: str) -> bool:
    """``cls.forward`` reads ``self.<attr>`` only as an argument of a call (a cache's
    ``update(k, v, self.layer_idx)``): a forward that compares it, indexes with it or computes
    with it may run other code in another block, which the two exported blocks' graphs would
    not show, so such a block counts as different. False where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    passed = {id(a) for call in ast.walk(tree) if isinstance(call, ast.Call)
              for a in [*call.args, *(k.value for k in call.keywords)]}
    return all(id(n) in passed for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and n.attr == attr and isinstance(n.value, ast.Name) and n.value.id == "self")


def signatures(blocks: nn.ModuleList) -> list | None:
    """Each block's signature (equal for blocks that trace alike); None when a block has a
    hook (it may change what the block computes)."""
    raw = [_modules(b) for b in blocks]
    if any(r is None for r in raw):
        return None
    index, shown = _index_attributes(raw), {}

    def key(v):  # one repr per object: the config every block holds is printed once
        if id(v) not in shown:
            shown[id(v)] = (v, repr(v))
        return shown[id(v)][1]

    return [[(name, cls, sorted((k, key(v)) for k, v in plain.items() if (name, k) not in index),
              tensors) for name, cls, plain, tensors in modules] for modules in raw]


def block_period(sigs: list) -> int | None:
    """The smallest period ``p`` with which blocks 1 .. n-1 repeat (blocks ``i`` and ``i + p``
    alike) and that divides the block count; None when there is none of at most n / 4."""
    n = len(sigs)
    for p in range(1, n // 4 + 1):
        if n % p == 0 and all(sigs[i] == sigs[i - p] for i in range(p + 1, n)):
            return p
    return None


def not_identical(sigs: list | None) -> str:
    """Why :func:`block_period` found none, in words for the plan's notes."""
    if sigs is None:
        return "a block has a forward hook"
    n = len(sigs)
    first = next(i for i in range(2, n) if sigs[i] != sigs[1])  # else the period would be 1
    names = [name or "the block" for (name, *a), b in zip(sigs[1], sigs[first]) if (name, *a) != b]
    where = names[0] if names else "its submodules"
    return (f"block {first} differs from block 1 ({where}) and no repeating pattern of blocks "
            f"divides the {n} blocks")
