"""What torch.export captures silently wrong for tensor parallelism, made loud.

- *Custom autograd Functions*: export traces through ``forward`` and keeps no trace of
  ``backward``, so a parallelized model would differentiate the forward's ops instead of the
  Function's own backward (straight-through estimators, recomputation tricks): gradients that
  differ from the model's. Detected by recording ``Function.apply`` during the capture, and
  refused unless the capture is inference-only (no backward can follow it).
- *Python state assigned in forward* (``self.step += 1``, ``self.cache = h``): the graph is
  traced once, so the parallelized model would run forever with the values of the capture call
  (export restores ints and warns about tensors, but keeps new attributes on the model).
  Detected with a forward hook that compares each module's attributes (and those of the plain
  helper objects a module holds) before and after the traced call; they are then restored
  exactly, new ones deleted, so no fake tensor stays behind on the user's model. Two kinds
  are told apart: a tensor rebound to itself seen again (``self.k = self.k[:]``, a view with
  the same shape, strides and offset; a ``.to()`` that changes nothing returns the tensor
  itself) is no state and is allowed; an attribute that was None before the call (a lazily
  built cache, ``if self._rope is None: self._rope = build()``) is refused with the fix that
  fits it: build it before ``parallelize``.

- *Method caches* (``functools.lru_cache`` / ``cache`` on a module's method: diffusers'
  NucleusMoE and Qwen-Image rotary tables, keyed by the frame and patch counts): a call traced
  by export fills them with fake tensors, which the next capture of the model (``explain``,
  then ``parallelize``) reads as constants of the graph ("a fake tensor in the exported
  program") and the user's next eager call gets back. They are emptied before every export
  (so the table is traced, not baked in from an eager call) and after it.

Buffers updated in place (``self.count.add_(1)``, BatchNorm's running statistics) are part of
the graph and are not affected: the parallelized module updates its own copies.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types

import torch
import torch._dynamo._trace_wrapped_higher_order_op  # ModIndex (see _HIGHER_ORDER_OPS)
import torch._functorch.autograd_function
from torch import nn

from tpcompile.errors import CaptureError

__all__ = ["forward_state_guard", "method_caches_emptied", "custom_function_calls",
           "custom_functions_verdict"]

_STANDARD = frozenset(nn.Module().__dict__)  # parameters, buffers, hooks, training...
_CUSTOM_OP_MACHINERY = os.path.dirname(torch._library.__file__)
# higher-order ops (flex attention) apply their own Functions under export, and ``ModIndex``
# (a score_mod's ``table[h]``) while their mods are traced; the op stays whole in the graph
# and applies them again when the graph runs, so their backward is kept. functorch wraps a
# Function applied under vmap (``create_block_mask`` vmaps a mask_mod) in a generated
# ``Vmapped...`` Function, applied after the Function itself, which is recorded on its own
_HIGHER_ORDER_OPS = (os.path.dirname(torch._higher_order_ops.__file__),
                     torch._dynamo._trace_wrapped_higher_order_op.__file__,
                     torch._functorch.autograd_function.__file__)


def _same_tensor(old, new) -> bool:
    """``new`` is ``old`` seen again: a view of it (or of its base) with its dtype, shape,
    strides and offset. Under export ``new`` is a fake tensor whose ``_base`` is ``old``."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor) or new is old:
        return new is old
    base = new._base
    return ((base is old or (base is not None and base is old._base))
            and (new.dtype, new.shape, new.stride(), new.storage_offset())
            == (old.dtype, old.shape, old.stride(), old.storage_offset()))


def _attributes(model: nn.Module) -> dict[str, dict[str, object]]:
    """Each module's own attributes by module name, and each plain helper object a module
    holds (Z-Image's ``RopeEmbedder``, which caches its frequencies on itself) by
    ``module.attribute`` name: forward can assign state on those too."""
    out = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out[name] = {k: v for k, v in m.__dict__.items() if k not in _STANDARD}
        for k, v in out[name].items():
            if _helper(v):
                out[f"{name}.{k}" if name else k] = dict(vars(v))
    return out


def _helper(value) -> bool:
    """A plain Python object with attributes of its own: not a module, tensor, class,
    function or config (a config's fields are the model's switches, not forward state)."""
    return (hasattr(value, "__dict__") and not isinstance(
        value, (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType,
                types.ModuleType, functools.partial))
            and not type(value).__name__.endswith("Config"))


def _holders(model: nn.Module, names) -> dict[str, dict]:
    """The ``__dict__`` each of ``_attributes``' names is read from."""
    modules = dict(model.named_modules(remove_duplicate=False))
    out = {}
    for name in names:
        if name in modules:
            out[name] = modules[name].__dict__
        else:
            owner, _, attr = name.rpartition(".")
            out[name] = vars(getattr(modules[owner], attr))
    return out


def _method_caches(model: nn.Module) -> list:
    """The ``functools`` caches on the methods of the classes of ``model``'s modules."""
    classes = {cls for m in model.modules() for cls in type(m).__mro__} - {object, nn.Module}
    found: dict[int, object] = {}
    for cls in classes:
        for value in vars(cls).values():
            fn = getattr(value, "__func__", value)  # a static / class method's function
            if callable(getattr(fn, "cache_clear", None)):
                found[id(fn)] = fn
    return list(found.values())


@contextlib.contextmanager
def method_caches_emptied(model: nn.Module):
    """Empty the model's method caches before a capture and after it (module docstring)."""
    caches = _method_caches(model)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for cache in caches:
            cache.cache_clear()


@contextlib.contextmanager
def forward_state_guard(model: nn.Module):
    """Restore every module's attributes afterwards; raise if the traced forward assigned any."""
    before = _attributes(model)
    assigned: set[str] = set()
    lazy: set[str] = set()

    def compare(module, args, output):
        for name, attrs in _attributes(model).items():
            old = before.get(name, {})
            prefix = f"self.{name}." if name else "self."
            for k in attrs.keys() | old.keys():
                if k in old and k in attrs and old[k] is None and attrs[k] is not None:
                    lazy.add(prefix + k)  # None before: a cache built on the first call
                elif k not in old or k not in attrs or not _same_tensor(old[k], attrs[k]):
                    assigned.add(prefix + k)

    handle = model.register_forward_hook(compare)
    try:
        yield
    finally:
        handle.remove()
        for name, state in _holders(model, before).items():
            attrs = before[name]
            for k in [k for k in state if k not in _STANDARD and k not in attrs]:
                del state[k]
            state.update(attrs)
    _refuse(assigned, lazy)


def _refuse(assigned: set[str], lazy: set[str]) -> None:
    """Raise for attributes forward assigned: state that changes, or a cache built lazily."""
    if lazy and not assigned:
        raise CaptureError(
            f"forward sets {', '.join(sorted(lazy))}, None before the call (a cache built on "
            "the first call, `if self.x is None: self.x = build(...)`): the graph is traced "
            "once, so every call would run the capture call's branch, its values baked in\n"
            "  hint: build it before parallelize, in __init__ or by calling the model once on "
            "an example input (tpcompile then reads the built tensor as a constant of the "
            "graph); state that changes on every call belongs in a buffer updated in place or "
            "in the inputs")
    if assigned or lazy:
        raise CaptureError(
            f"forward assigns Python state: {', '.join(sorted(assigned | lazy))}; the parallelized "
            "module runs the graph traced once, so it would keep the values of the capture call "
            "forever\n  hint: keep state that changes in a buffer updated in place "
            "(self.register_buffer('step', torch.zeros(())); self.step.add_(1)), or pass it as "
            "an input")


@contextlib.contextmanager
def custom_function_calls():
    """Record every ``torch.autograd.Function`` applied by this thread inside the block.

    Yields a list that fills with ``(Function class name, 'file:line' of the call)``.
    ``Function.apply`` is wrapped for the duration of the block only (and restored even on an
    error): detecting the Functions from the captured nodes' stack traces instead would need
    torch.export to record a stack trace per node, a sixth of a capture's time. A Function
    that overrides ``apply`` itself is not seen. torch's custom-op machinery applies its own
    Functions around ops registered with ``torch.library.custom_op``, and higher-order ops
    (``flex_attention``) around themselves; those ops stay whole in the graph with their
    backward, so those Functions are not recorded.
    """
    original = torch.autograd.Function.__dict__["apply"]
    thread, calls = threading.get_ident(), []

    def apply(cls, *args, **kwargs):
        forward = getattr(cls.forward, "__code__", None)
        if threading.get_ident() == thread and not (
                forward is not None
                and forward.co_filename.startswith((_CUSTOM_OP_MACHINERY, *_HIGHER_ORDER_OPS))):
            caller = sys._getframe(1)
            calls.append((cls.__qualname__, f"{caller.f_code.co_filename}:{caller.f_lineno}"))
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield calls
    finally:
        torch.autograd.Function.apply = original


def custom_functions_verdict(calls: list[tuple[str, str]], inference: bool) -> str:
    """What the custom autograd Functions the traced forward applied mean for the capture.

    None applied: "". Training (``inference`` False): raise, the gradients would not be the
    model's (see the module doc). An inference-only capture (under ``torch.no_grad()``, or a
    model with no trainable parameter: torchao's dynamic activation quantization rounds
    through a straight-through ``_Round``) runs the forward exactly, and no backward follows
    it: the returned note says why the module then refuses a call that could start one
    (:attr:`tpcompile.core.plan.ShardingPlan.inference_only`)."""
    if not calls:
        return ""
    names = ", ".join(sorted({name for name, _ in calls}))
    name, where = calls[0]
    if not inference:
        raise CaptureError(
            f"{name} is a custom torch.autograd.Function (applied at {where}): torch.export "
            "traces through its forward and drops its backward, so the parallelized model's "
            "gradients would not be the model's\n  hint: register it as a custom op "
            "(torch.library.custom_op with register_autograd): tpcompile keeps such an op "
            "whole (gathering sharded inputs) and its backward runs as written; for inference "
            "only, parallelize under torch.no_grad() (or freeze the model with "
            "requires_grad_(False))")
    return (f"inference only: the forward applies custom autograd Functions ({names}, first at "
            f"{where}) whose backward torch.export drops, so no gradient may flow through "
            "this module")
