"""Capture: ``nn.Module`` -> ATen FX graph, with parameters named by their FQNs.

tpcompile plans on the graph ``torch.export.export(strict=False)`` produces before any
decomposition: ``aten.linear`` and ``aten.scaled_dot_product_attention`` are still whole, every
node carries ``meta['val']`` (a FakeTensor, so shapes and dtypes are known without memory), and
``ep.module()`` reads parameters through ``get_attr`` nodes whose targets are the FQNs users
know. Export traces with fake tensors, so no real activation is ever computed here.

What export would capture silently wrong (custom autograd Functions, Python attributes assigned
in forward) is refused by :mod:`tpcompile.core.capture_checks`. Hugging Face KV caches are
switched off for the capture in every config the model reads
(:mod:`tpcompile.core.cache_configs`).

Every input dimension is exported as ``Dim.AUTO``: batch and sequence lengths stay symbolic and
the rewritten module accepts other sizes; dimensions the model fixes are specialised by export.

Export runs without FX stack traces (``node.meta['stack_trace']``): recording one per node is a
sixth of a large model's capture time (``bench/planning.py --breakdown``), and only error
messages read them: the in-place write checks name the model line that writes. A graph with
in-place ops is therefore captured a second time with stack traces.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import traceback
import warnings
from dataclasses import dataclass, replace

import torch
from torch import fx, nn
from torch.export import Dim
from torch.utils._pytree import tree_leaves

from tpcompile.compat import stack_traces as recorded_stack_traces
from tpcompile.core.block_masks import (
    flex_capture, flex_sizes_fixed, register_block_mask, static_leaves,
)
from tpcompile.core.cache_configs import cache_hint, caches_off
from tpcompile.core.canonical_order import canonical_order
from tpcompile.core.checkpoint_marks import checkpoint_marks, stamp_regions
from tpcompile.core.subclass_weights import subclass_parts, unwrap_subclass_weights
from tpcompile.core.capture_checks import (
    custom_function_calls, custom_functions_verdict, forward_state_guard, method_caches_emptied,
)
from tpcompile.errors import CaptureError

__all__ = ["Capture", "capture", "param_aliases", "concrete_shape", "IN_PLACE"]

# a module's attribute declaring that its forward writes its buffers in place (the static-cache
# wrapper's KV cache): its one export records the model lines that graphs with in-place ops
# keep, instead of a second export once the first graph shows the writes
IN_PLACE = "writes_buffers_in_place"


@dataclass
class Capture:
    """The captured graph and what the passes need to know about its attributes."""

    gm: fx.GraphModule
    # get_attr target -> every FQN of the model that names the same tensor (tied weights)
    aliases: dict[str, tuple[str, ...]]
    # get_attr targets that are floating-point parameters, trainable or frozen: the weights
    # the planner may shard (the rest are buffers / constants, kept whole)
    params: frozenset[str]
    # the subset of ``params`` that requires grad: only these start gradients and get synced
    trainable: frozenset[str]
    input_specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    notes: tuple[str, ...] = ()  # what capture changed about the call (shown by the plan)
    # why no backward may run through the graph (capture_checks.custom_functions_verdict)
    inference_only: str = ""
    # get_attr targets holding the parts of tensor-subclass weights (torchao's qdata, scales)
    subclass_parts: frozenset[str] = frozenset()
    # (block list path, blocks) when core.stamp exported three blocks and repeated the rest
    reused: tuple[str, int] | None = None


# code that is not the model's: torch, tpcompile and the standard library
_LIBRARIES = tuple(os.path.dirname(m.__file__) for m in (torch, contextlib)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(
            f"example_inputs must be a tuple of tensors shaped like a real call, got "
            f"{type(example_inputs).__name__}; wrap a single tensor as (x,)")
    return tuple(example_inputs)


def _concrete(x, device: torch.device):
    """Meta example inputs are replaced by zeros (valid token ids too) on the model's device;
    a model built on the meta device gets its inputs there too (fake tensors refuse a meta /
    CPU mix in one op before torch 2.13)."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        return torch.zeros(x.shape, dtype=x.dtype, device=device)
    if isinstance(x, torch.Tensor) and device.type == "meta":
        return x.to(device)
    return x


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _user_frame(err: BaseException) -> str:
    """The model source line export blames, e.g. 'model.py:13: if x.sum() > 0:', else the
    innermost line of the model's own code in the traceback, with the error's first line."""
    text = str(err)
    m = re.search(r'File "([^"]+)", line (\d+), in \w+\n\s+(.+)', text)
    if m:
        return f"{m.group(1)}:{m.group(2)}: {m.group(3).strip()}"
    said = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_LIBRARIES)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()} " \
           f"({said})" if frames else said


def param_aliases(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(tensor) -> every FQN that names it, for parameters and buffers (ties included)."""
    out: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(t), []).append(name)
    for name, t in model.named_buffers(remove_duplicate=False):
        out.setdefault(id(t), []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def _auto(x, static: tuple[int, ...]):
    """Every dim of every tensor dynamic but ``static`` (export specialises what the model fixes)."""
    if isinstance(x, torch.Tensor):
        return {d: Dim.AUTO for d in range(x.dim()) if d not in static}
    if isinstance(x, dict):
        return {k: _auto(v, static) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        items = [_auto(v, static) for v in x]
        return type(x)(*items) if hasattr(type(x), "_fields") else type(x)(items)  # NamedTuple
    return static_leaves(x)  # a BlockMask: its tensors static, None for a non-tensor


# torch.export's loggers whose warnings speak of choices capture made, not the user: a size-1
# example dim "0/1 specialized" under the Dim.AUTO capture asked for (capture's own note,
# _specialised_sizes, says what it fixed and how to keep it dynamic)
EXPORT_LOGGERS = ("torch._export.non_strict_utils",)


@contextlib.contextmanager
def _export_logs_quiet():
    loggers = [logging.getLogger(name) for name in EXPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _writes_in_place(gm: fx.GraphModule) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in gm.graph.nodes if n.op == "call_function")


def _named_inputs(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """forward's parameter names -> the example values bound to them (what export keys on)."""
    return inspect.signature(model.forward).bind(*args, **kwargs).arguments


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic: bool, static: tuple[int, ...],
            stack_traces: bool):
    shapes = None
    if dynamic:
        shapes = {name: _auto(value, static)
                  for name, value in _named_inputs(model, args, kwargs).items()}
    with (warnings.catch_warnings(), _export_logs_quiet(),
          recorded_stack_traces(stack_traces) as settle, checkpoint_marks(model) as regions,
          flex_capture(), method_caches_emptied(model)):
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, args, kwargs=kwargs or None, dynamic_shapes=shapes,
                                 strict=False)
    settle(ep.graph_module)
    if regions:  # the model checkpoints regions: kept as regions (tpcompile.core.checkpoint_marks)
        stamp_regions(ep.graph_module)
    return ep


def capture(model: nn.Module, example_inputs, example_kwargs: dict | None = None,
            dynamic: bool = True, static_dims: tuple[int, ...] = (),
            stack_traces: bool = False) -> Capture:
    """Export ``model(*example_inputs, **example_kwargs)`` and unlift it into a GraphModule.

    ``static_dims``: input dims kept at their example size (sequence parallelism cuts dim 1
    into fixed shards). ``stack_traces``: keep each node's model line (inspection names it;
    graphs with in-place ops always keep them, so write conflicts name the line).

    Raises :class:`CaptureError` naming the model line export could not trace, with the fix.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected an nn.Module, got {type(model).__name__}")
    register_block_mask()
    device = _model_device(model)
    args = tuple(_concrete(x, device) for x in _as_tuple(example_inputs))
    kwargs = {k: _concrete(v, device) for k, v in (example_kwargs or {}).items()}
    stack_traces = stack_traces or getattr(model, IN_PLACE, False)
    notes: list[str] = []
    if dynamic and (fixed := flex_sizes_fixed(model)):
        dynamic = False
        notes.append(fixed)
    if dynamic:
        notes += _specialised_sizes(model, args, kwargs, static_dims)
    try:
        with (caches_off(model, notes), forward_state_guard(model),
              custom_function_calls() as applied):
            ep = _export(model, args, kwargs, dynamic, static_dims, stack_traces=stack_traces)
        inference_only = custom_functions_verdict(applied, _inference_capture(model))
        if not stack_traces and _writes_in_place(ep.graph_module):
            with caches_off(model, []), forward_state_guard(model):
                ep = _export(model, args, kwargs, dynamic, static_dims, stack_traces=True)
    except CaptureError:
        raise
    except torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode as e:
        raise CaptureError(
            f"cannot capture data-dependent control flow at {_user_frame(e)}\n"
            "  hint: a Python `if` on a tensor's value cannot be traced; use torch.cond, "
            "torch.where, or make the condition a constructor argument") from e
    except Exception as e:  # noqa: BLE001 - every export failure becomes one actionable error
        if dynamic:
            try:
                cap = capture(model, example_inputs, example_kwargs, dynamic=False,  # all static
                              stack_traces=stack_traces)
            except CaptureError:
                pass
            else:
                return _noted(cap, f"captured with static shapes: export with dynamic batch and "
                                   f"sequence sizes failed ({type(e).__name__}); the module "
                                   "accepts only the example's sizes")
        hint = cache_hint(e) or ("tpcompile captures with torch.export(strict=False); make "
                                 "forward traceable (no data-dependent Python control flow, "
                                 "tensors in and out)")
        raise CaptureError(f"torch.export could not capture {type(model).__name__}: "
                           f"{type(e).__name__} at {_user_frame(e)}\n  hint: {hint}") from e
    gm = canonical_order(ep.module())
    notes += unwrap_subclass_weights(gm)
    aliases, params, trainable = attribute_info(gm, model)
    specs = tuple((tuple(a.shape), a.dtype) for a in tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor))
    if inference_only:
        notes.append(inference_only)
    return _noted(Capture(gm, aliases, params, trainable, specs, inference_only=inference_only,
                          subclass_parts=subclass_parts(model, gm)), *notes)


def _inference_capture(model: nn.Module) -> bool:
    """No backward can follow this capture's call: it runs under ``torch.no_grad()`` (or
    ``inference_mode``), or the model has no trainable parameter."""
    return not torch.is_grad_enabled() or not any(p.requires_grad for p in model.parameters())


def attribute_info(gm: fx.GraphModule, model: nn.Module):
    """(get_attr target -> the model's FQNs of that tensor, weight targets, trainable ones).

    A weight is a floating-point ``nn.Parameter`` whether or not it requires grad: a frozen
    base model (LoRA, ``requires_grad_(False)`` for inference) is planned like a trainable
    one. Only the trainable ones start gradients."""
    aliases_by_id = param_aliases(model)
    aliases, params, trainable = {}, set(), set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = fetch(gm, node.target)
        if isinstance(t, torch.Tensor):
            aliases[node.target] = aliases_by_id.get(id(t), (node.target,))
            if isinstance(t, nn.Parameter) and (t.is_floating_point() or t.is_complex()):
                params.add(node.target)
                if t.requires_grad:
                    trainable.add(node.target)
    return aliases, frozenset(params), frozenset(trainable)


def _noted(cap: Capture, *notes: str) -> Capture:
    """Record what capture changed about the call; those that limit the module also warn."""
    for note in notes:
        if "accepts only" in note:
            warnings.warn(f"tpcompile: {note}", stacklevel=4)
    return replace(cap, notes=cap.notes + notes)


def _specialised_sizes(model: nn.Module, args: tuple, kwargs: dict, static: tuple[int, ...]):
    """Batch and sequence dims of size 0 or 1 in the example: export fixes them to that size
    (it specialises 0 and 1), so a later call with batch 2 would be refused."""
    try:
        bound = _named_inputs(model, args, kwargs)
    except TypeError:  # export names the mismatch itself
        return []
    out = []
    for name, value in bound.items():
        if static_leaves(value) is not None:  # a BlockMask: built for its sizes, kept static
            continue
        for t in tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            for d in range(min(t.dim(), 2)):
                if d not in static and t.shape[d] in (0, 1):
                    out.append(f"input {name} has size {t.shape[d]} at dim {d}: export fixes "
                               f"it, so the module accepts only {t.shape[d]} there; give an "
                               "example with size >= 2 to keep it dynamic")
                    break
    return out


def fetch(root: nn.Module, target: str):
    """The attribute a ``get_attr`` target names under ``root`` (``"layers.0.w"``)."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def set_tensor(root: nn.Module, fqn: str, value) -> None:
    """Put ``value`` (a Parameter or buffer) at ``fqn`` under ``root``, replacing the old one."""
    owner, _, leaf = fqn.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    if isinstance(value, nn.Parameter):
        mod._parameters[leaf] = value
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        setattr(mod, leaf, value)


def concrete_shape(value) -> list:
    """A tensor's shape with symbolic sizes replaced by the example inputs' sizes (a size
    with no example value stays symbolic, as its text)."""
    out = []
    for s in value.shape:
        if isinstance(s, torch.SymInt):
            hint = s.node.hint
            s = int(hint) if hint is not None else str(s)
        out.append(int(s) if isinstance(s, int) else s)
    return out


def module_path(node: fx.Node) -> str:
    """The module a node was traced in ('layers.0.attention.wo'), '' for the top level."""
    if node.op == "get_attr":
        return node.target.rpartition(".")[0]
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        return path if not path.startswith("_empty_nn_module_stack") else ""
    return ""


def origin(node: fx.Node) -> str:
    """Where a node comes from in the model: its module path and, when the capture kept stack
    traces (``explain`` does), the model's file and line: ``layers.1.attn, model.py:212``."""
    where = [module_path(node) or "top level"]
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    frames = [f for f in frames if "/torch/" not in f[0]] or frames  # the model's, not nn.Linear's
    if frames:
        path, line = frames[-1]
        where.append(f"{path.rsplit('/', 1)[-1]}:{line}")
    return ", ".join(where)
