"""What torch.export captures silently wrong for tensor parallelism, made loud.

- *Custom autograd Functions*: export traces through ``forward`` and keeps no trace of
  ``backward``, so a parallelized model would differentiate the forward's ops instead of the
  Function's own backward (straight-through estimators, recomputation tricks): gradients that
  differ from the model's. Detected from the captured nodes' stack traces.
- *Python state assigned in forward* (``self.step += 1``, ``self.cache = h``): the graph is
  traced once, so the parallelized model would run forever with the values of the capture call
  (export restores ints and warns about tensors, but keeps new attributes on the model).
  Detected with a forward hook that compares each module's attributes before and after the
  traced call; the model's attributes are then restored exactly, new ones deleted.

Buffers updated in place (``self.count.add_(1)``, BatchNorm's running statistics) are part of
the graph and are not affected: the parallelized module updates its own copies.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import fx, nn

from tpcompile.errors import CaptureError

__all__ = ["forward_state_guard", "check_autograd_functions"]

_STANDARD = frozenset(nn.Module().__dict__)  # parameters, buffers, hooks, training...


def _attributes(model: nn.Module) -> dict[str, dict[str, object]]:
    return {name: {k: v for k, v in m.__dict__.items() if k not in _STANDARD}
            for name, m in model.named_modules(remove_duplicate=False)}


@contextlib.contextmanager
def forward_state_guard(model: nn.Module):
    """Restore every module's attributes afterwards; raise if the traced forward assigned any."""
    before = _attributes(model)
    assigned: set[str] = set()

    def compare(module, args, output):
        for name, attrs in _attributes(model).items():
            old = before.get(name, {})
            prefix = f"self.{name}." if name else "self."
            assigned.update(prefix + k for k in attrs.keys() | old.keys()
                            if k not in old or k not in attrs or attrs[k] is not old[k])

    handle = model.register_forward_hook(compare)
    try:
        yield
    finally:
        handle.remove()
        modules = dict(model.named_modules(remove_duplicate=False))
        for name, attrs in before.items():
            state = modules[name].__dict__
            for k in [k for k in state if k not in _STANDARD and k not in attrs]:
                del state[k]
            state.update(attrs)
    if assigned:
        raise CaptureError(
            f"forward assigns Python state: {', '.join(sorted(assigned))}; the parallelized "
            "module runs the graph traced once, so it would keep the values of the capture call "
            "forever\n  hint: keep state that changes in a buffer updated in place "
            "(self.register_buffer('step', torch.zeros(())); self.step.add_(1)), or pass it as "
            "an input")


def _function_forwards() -> dict[str, list[tuple[int, int, str]]]:
    """file -> [(first line, last line, class)] of every custom autograd Function's forward."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    todo, seen = list(torch.autograd.Function.__subclasses__()), set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        forward = cls.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        if code is None:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        out.setdefault(code.co_filename, []).append((min(lines), max(lines), cls.__qualname__))
    return out


def check_autograd_functions(gm: fx.GraphModule) -> None:
    """Raise if a captured op was traced from inside a custom autograd Function's forward."""
    forwards = None
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if not trace:
            continue
        frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
        forwards = _function_forwards() if forwards is None else forwards
        for i, (path, line) in enumerate(frames):
            hit = next((name for lo, hi, name in forwards.get(path, ())
                        if lo <= int(line) <= hi), None)
            if hit is None:
                continue
            called = f" (applied at {frames[i - 1][0]}:{frames[i - 1][1]})" if i else ""
            raise CaptureError(
                f"{hit} is a custom torch.autograd.Function{called}: torch.export traces through "
                "its forward and drops its backward, so the parallelized model's gradients "
                "would not be the model's\n  hint: register it as a custom op "
                "(torch.library.custom_op with register_autograd): tpcompile keeps such an op "
                "whole (gathering sharded inputs) and its backward runs as written")
