"""Build a tensor-parallel model without ever holding the full model on a rank.

The recipe: construct the model under ``torch.device("meta")`` (no memory), ``parallelize`` it
(capture and planning only need shapes, so the local shards come out on meta too), then give
the shards real memory and values, either from a full checkpoint
(:func:`tpcompile.load_full_state_dict`, which reads only this rank's slices) or by running
the modules' own initialisers (:func:`init_shards`).

Three things a meta model lacks are handled here:

* memory: :func:`to_empty` allocates every local shard on the target device (uninitialised);
* device constants: ops the graph creates tensors with (``torch.full(..., device=x.device)``)
  were captured as ``device='meta'`` and are retargeted (``passes/rewrite/retarget_device.py``);
* non-persistent buffers (RoPE tables, causal masks): they are in no state dict, so their
  values must come from the model code. :func:`buffers_of` re-runs the model's constructor with
  its parameters on meta, which costs only the buffers' memory; modules built from a config
  (Hugging Face) are rebuilt from it without one (:mod:`tpcompile.state.config_buffers`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from tpcompile.errors import TPCompileError
from tpcompile.state.config_buffers import config_buffers
from tpcompile.passes.rewrite.retarget_device import retarget_device_pass
from tpcompile.runtime.module import TPModule
from tpcompile.core.shards import placements_by_fqn, take_shard

__all__ = ["params_on_meta", "buffers_of", "has_meta", "to_empty", "init_shards"]

META = torch.device("meta")


@contextlib.contextmanager
def params_on_meta():
    """Modules built inside get meta parameters; their buffers are computed for real.

    Each parameter is moved to meta as it is registered, before its initialiser runs, so only
    an uninitialised (untouched) allocation ever exists for it.
    """
    def to_meta(module, name, param):
        if type(param) is not nn.Parameter or param.device == META:
            return None  # tied (already meta), or a Parameter subclass we cannot rebuild
        return nn.Parameter(param.to(META), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def buffers_of(factory: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    """The buffers ``factory()`` computes, by FQN, without allocating its parameters."""
    with params_on_meta():
        model = factory()
    return dict(model.named_buffers())


def has_meta(tp: TPModule) -> bool:
    return any(t.device == META for t in list(tp.parameters()) + list(tp.buffers()))


def _non_persistent(tp: nn.Module) -> list[str]:
    return [f"{prefix}.{name}" if prefix else name
            for prefix, mod in tp.named_modules() for name in mod._non_persistent_buffers_set
            if mod._buffers.get(name) is not None]


def _meta_constants(tp: TPModule) -> list[str]:
    """Tensor attributes of the graph that are neither parameters nor buffers and still meta."""
    known = {id(t) for t in list(tp.parameters()) + list(tp.buffers())}
    out = []
    for prefix, mod in tp.graph_module.named_modules():
        for name, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and value.device == META and id(value) not in known:
                out.append(f"{prefix}.{name}" if prefix else name)
    return out


def _allocate(tp: TPModule, device: torch.device) -> None:
    """Replace every parameter and buffer by an empty one on ``device``, keeping ties.

    ``nn.Module.to_empty`` would give each module holding a tied parameter its own new tensor;
    here one old tensor maps to one new tensor wherever it is registered (the graph's modules
    and the TPModule's own top-level entries alike).
    """
    new: dict[int, torch.Tensor] = {}

    def fresh(t):
        if id(t) not in new:
            empty = torch.empty_like(t, device=device)
            new[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return new[id(t)]

    for mod in [tp, *tp.graph_module.modules()]:
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fresh(t)


def to_empty(tp: TPModule, device="cpu", buffers: dict[str, torch.Tensor] | None = None) -> TPModule:
    """Give a meta-built ``tp`` real (uninitialised) shards on ``device``, in place.

    ``buffers`` supplies the non-persistent buffers by FQN (full values, e.g. from
    :func:`buffers_of`). Those not given are recomputed from the model's config when ``tp``
    kept a meta copy of the model (Hugging Face causal LMs, models with a static KV cache;
    :mod:`tpcompile.state.config_buffers`); otherwise every one that is still meta must be
    given, since nothing else can produce it. Persistent parameters and buffers are left for
    a loader or initialiser to fill.
    """
    device = torch.device(device)
    buffers = dict(buffers or {})
    needed = [n for n in _non_persistent(tp) if tp.get_buffer(n).device == META]
    missing = [n for n in needed if n not in buffers]
    skeleton = getattr(tp.skeleton_capture, "skeleton", None)  # kept for generate / decode
    if missing and skeleton is not None:
        buffers.update(config_buffers(skeleton, missing))
    elif missing:
        raise TPCompileError(
            f"non-persistent buffers {missing} were built on the meta device and are in no state "
            "dict, so their values cannot be loaded; pass buffers=tpcompile.buffers_of(lambda: "
            "MyModel(cfg)) (re-runs the constructor with parameters on meta) or a dict of them")
    constants = _meta_constants(tp)
    if constants:
        raise TPCompileError(
            f"the captured graph holds tensor constants {constants} created on the meta device: "
            "their values were never computed; register them as buffers in the model instead")
    _allocate(tp, device)
    placements = placements_by_fqn(tp.plan)
    with torch.no_grad():
        for name in needed:
            full = buffers[name]
            tp.get_buffer(name).copy_(take_shard(full, placements.get(name), tp.plan.specs, tp.rank))
    retarget_device_pass(tp.graph_module, device)  # not in the pipeline: it ran long before
    tp.graph_module.recompile()
    return tp


def _own_tensors(mod: nn.Module) -> dict[str, torch.Tensor]:
    """A module's direct parameters and persistent buffers (what ``reset_parameters`` sets)."""
    out = {n: p for n, p in mod._parameters.items() if p is not None}
    out.update({n: b for n, b in mod._buffers.items()
                if b is not None and n not in mod._non_persistent_buffers_set})
    return out


def _full_size_copy(mod: nn.Module, device: torch.device) -> nn.Module:
    """``mod`` with its own tensors real and full-size on ``device``; children stay shared."""
    scratch = copy.copy(mod)
    scratch._parameters = {n: None if p is None else nn.Parameter(
        torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for n, p in mod._parameters.items()}
    scratch._buffers = {n: None if b is None else torch.empty_like(b, device=device)
                        for n, b in mod._buffers.items()}
    return scratch


def _init_module(tp: TPModule, mod: nn.Module, prefix: str, device: torch.device,
                 targets: dict[str, torch.Tensor], filled: set[int]) -> None:
    """Initialise ``mod``'s own tensors at full size and keep this rank's slices of them.

    The full-size copy lives only inside this call, so at most one module is whole at a time.
    """
    placements = placements_by_fqn(tp.plan)
    scratch = _full_size_copy(mod, device)
    scratch.reset_parameters()
    for name, full in _own_tensors(scratch).items():
        fqn = f"{prefix}.{name}" if prefix else name
        local = targets.get(fqn)
        if local is None or id(local) in filled:
            continue  # unused by the graph, or tied and set by an earlier module
        local.copy_(take_shard(full, placements.get(fqn), tp.plan.specs, tp.rank))
        filled.add(id(local))


def init_shards(tp: TPModule, model: nn.Module, device="cpu",
                buffers: dict[str, torch.Tensor] | None = None) -> TPModule:
    """Fill ``tp``'s shards by running ``model``'s ``reset_parameters`` initialisers.

    ``model`` is the (meta) model ``tp`` was parallelized from. Its modules are visited in
    ``named_modules`` order; each one that has ``reset_parameters`` is initialised at full size
    on ``device`` (one module at a time, so the peak is the shards plus the largest module) and
    this rank keeps its slices. Initialisers see full shapes, so fan-in based schemes are right
    for row-parallel weights too; with the same seed on every rank the shards agree, and they
    equal a model built eagerly with that seed when construction order is ``named_modules``
    order. A tensor that is initialised by no module is an error naming it.
    """
    if has_meta(tp):
        to_empty(tp, device, buffers)
    device = torch.device(device)
    targets = tp.state_dict(keep_vars=True)
    filled: set[int] = set()
    with torch.no_grad():
        for prefix, mod in model.named_modules():
            if _own_tensors(mod) and callable(getattr(mod, "reset_parameters", None)):
                _init_module(tp, mod, prefix, device, targets, filled)
    missing = sorted(n for n, t in targets.items() if id(t) not in filled)
    if missing:
        raise TPCompileError(
            f"no module initialiser covers {missing}: give their modules a reset_parameters() "
            "method, or fill them with tpcompile.load_full_state_dict")
    return tp
