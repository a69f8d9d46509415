"""Which module call Dynamo is compiling, and the call laid out for export and for later calls.

The ``"tpcompile"`` backend receives a graph, not a module. Dynamo's translator for the frame
being compiled is still current while the backend runs, and its ``output.local_scope`` holds
the frame's real arguments. The frame is the module's ``forward``, the outermost decorator
around it (transformers wraps ``forward`` in ``functools.wraps`` wrappers that take ``(*args,
**kwargs)``), or, for ``torch.nn`` classes, the wrapper Dynamo adds around ``module(...)``.

The call is bound to the signature of the function the decorators wrap and laid out once
(:class:`CallLayout`): tensors up to the first parameter left at its default are positional,
later ones keyword; parameters at their defaults are left out (export uses the defaults too);
anything else that is not a tensor would be baked into the graph, so it is refused. Later
calls, however they pass the same tensors (``model(ids, attention_mask=m)`` or
``model(input_ids=ids, attention_mask=m)``), are laid out the same way before they reach the
rewritten graph, whose export spec is strict about positional and keyword.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
from torch import nn

from tpcompile.errors import TPCompileError

__all__ = ["CallLayout", "current_code", "frame_call", "frame_name", "where"]

_EMPTY = {inspect.Parameter.VAR_POSITIONAL: (), inspect.Parameter.VAR_KEYWORD: {}}


@dataclass(frozen=True)
class CallLayout:
    """How a module's calls reach its rewritten graph: the named positional parameters in
    signature order, the ones passed positionally (``*name``: a ``*args`` of tensors), the ones
    passed by keyword."""

    params: tuple[str, ...]
    positional: tuple[str, ...]
    keyword: tuple[str, ...]

    def arrange(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of a call, laid out as at capture (a missing tensor is None: the
        TPModule's input check names it); ``*name`` stands for the extra positional ones."""
        values = dict(zip(self.params, args))
        values.update(kwargs)
        out = []
        for n in self.positional:
            out.extend(args[len(self.params):] if n.startswith("*") else (values.get(n),))
        return tuple(out), {n: values[n] for n in self.keyword if n in values}


def frame_call():
    """``(module, call)`` of the module call Dynamo is compiling, ``(None, None)`` for any
    other frame. ``call()`` returns ``(args, kwargs, layout)`` or raises
    :class:`TPCompileError` for a call it cannot replay."""
    from torch._dynamo.external_utils import wrap_inline

    code, scope = _current_frame()
    if code is None:
        return None, None
    if code is wrap_inline(frame_call).__code__ and isinstance(scope.get("fn"), nn.Module):
        root = scope["fn"]
        return root, lambda: _laid_out(root, [root, *scope["args"]], scope["kwargs"])
    args, kwargs = _frame_arguments(code, scope)
    root = args[0] if args else None
    forward = getattr(type(root), "forward", None)
    if not isinstance(root, nn.Module) or getattr(forward, "__code__", None) is not code:
        return None, None
    return root, lambda: _laid_out(root, args, kwargs)


def current_code():
    """The code object of the frame Dynamo is compiling (None outside a compile)."""
    return _current_frame()[0]


def frame_name() -> str | None:
    """``name (file:line)`` of the frame Dynamo is compiling; None for the resume function of
    a graph break, whose frame was reported already."""
    code, _ = _current_frame()
    if code is None or code.co_name.startswith("torch_dynamo_resume_in_"):
        return None
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def where(stack) -> str:
    """``file:line `source``` of the innermost frame of a Dynamo user stack."""
    if not stack:
        return "an unknown line"
    frame = stack[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`"


def _current_frame() -> tuple:
    """``(code, locals)`` of the frame Dynamo is compiling, ``(None, {})`` outside a compile."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # called outside a Dynamo compile (e.g. on a hand-made graph)
        return None, {}
    return getattr(tx, "f_code", None), getattr(getattr(tx, "output", None), "local_scope", {})


def _frame_arguments(code, scope: dict) -> tuple[list, dict]:
    """The ``(args, kwargs)`` the frame of ``code`` was called with, read off its locals."""
    names = code.co_varnames
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    args = [scope[n] for n in names[:n_pos] if n in scope]
    kwargs = {n: scope[n] for n in names[n_pos:n_pos + n_kw] if n in scope}
    at = n_pos + n_kw
    if code.co_flags & inspect.CO_VARARGS:
        args.extend(scope.get(names[at], ()))
        at += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(scope.get(names[at], {}))
    return args, kwargs


def _refuse(root: nn.Module, what: str) -> TPCompileError:
    return TPCompileError(
        f"{type(root).__name__}.forward is called with {what}; the backend shards forwards called "
        "with tensors (and defaults) only: make it a constructor argument, or call "
        "tpcompile.parallelize yourself")


def _laid_out(root: nn.Module, args: list, kwargs: dict) -> tuple[tuple, dict, CallLayout]:
    """This call of ``root.forward`` (``args[0]`` is ``root``) as ``(args, kwargs, layout)``."""
    signature = inspect.signature(inspect.unwrap(type(root).forward))
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError as e:
        raise _refuse(root, f"arguments its signature does not take ({e})") from None
    params = list(signature.parameters.values())[1:]
    positional, keyword, defaulted = {}, {}, False
    for p in params:
        v = bound.get(p.name, _EMPTY.get(p.kind, p.default))
        if p.kind is p.VAR_POSITIONAL:
            if v and (defaulted or not all(isinstance(x, torch.Tensor) for x in v)):
                raise _refuse(root, f"'*{p.name}' holding non-tensors or after a default")
            if v:
                positional[f"*{p.name}"] = v
        elif p.kind is p.VAR_KEYWORD:
            bad = [k for k, x in v.items() if not isinstance(x, torch.Tensor)]
            if bad:
                raise _refuse(root, f"'{bad[0]}' = a {type(v[bad[0]]).__name__}")
            keyword.update(v)
        elif isinstance(v, torch.Tensor):
            (keyword if defaulted or p.kind is p.KEYWORD_ONLY else positional)[p.name] = v
        elif p.default is p.empty or not _is_default(v, p.default):
            raise _refuse(root, f"'{p.name}' = a {type(v).__name__}")
        else:
            defaulted = True
    named = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    args = [x for n, v in positional.items() for x in (v if n.startswith("*") else (v,))]
    return tuple(args), keyword, CallLayout(named, tuple(positional), tuple(keyword))


def _is_default(v, default) -> bool:
    if v is default:
        return True
    try:
        return not isinstance(v, torch.Tensor) and bool(v == default)
    except Exception:  # noqa: BLE001 - an object whose == is not a bool is not a default
        return False
