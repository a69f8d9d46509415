"""Non-persistent buffers recomputed from a model's config (RoPE tables, causal masks).

A model built on the meta device has its non-persistent buffers on meta too, and they are in
no checkpoint, so their values must come from the model code. Hugging Face modules are
constructed from a config (``LlamaRotaryEmbedding(config)``, ``LlamaForCausalLM(config)``) and
keep it as ``.config``; their buffers are functions of it. :func:`config_buffers` therefore
rebuilds, for each buffer, the nearest module at or above its owner that holds a ``config``,
as ``type(module)(module.config)`` with its parameters on meta (so only buffers get memory),
and reads the buffer from the copy. The copy is built twice and must agree: a buffer that
differs (drawn at random) or that no config-built module yields is an error naming it.
"""

from __future__ import annotations

import torch
from torch import nn

from tpcompile.errors import TPCompileError

__all__ = ["config_buffers"]


def _ancestors(path: str) -> list[str]:
    """A module path and its parents, nearest first: ``"a.b"`` -> ``["a.b", "a", ""]``."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _build_from_config(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of ``type(module)(module.config)``, built with its parameters on meta."""
    from tpcompile.state.meta_init import params_on_meta  # meta_init imports this module

    with params_on_meta(), torch.device("cpu"):
        return dict(type(module)(module.config).named_buffers())


class _Builds:
    """Config-built copies of a model's modules, by module path: each built once (twice, to
    check the buffers agree), or the reason it could not be."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.built: dict[str, dict[str, torch.Tensor] | str] = {}

    def buffers(self, prefix: str) -> dict[str, torch.Tensor] | str:
        if prefix not in self.built:
            module = self.model.get_submodule(prefix)
            if getattr(module, "config", None) is None:
                self.built[prefix] = f"{prefix or 'the model'} has no .config"
            else:
                try:
                    first, second = _build_from_config(module), _build_from_config(module)
                except Exception as e:  # noqa: BLE001 - a parent module may still build
                    self.built[prefix] = (f"{type(module).__name__}(config) failed: "
                                          f"{type(e).__name__}: {e}")
                else:
                    self.built[prefix] = {n: b for n, b in first.items()
                                          if n in second and _same(b, second[n])}
        return self.built[prefix]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _one(builds: _Builds, name: str, want: torch.Tensor) -> torch.Tensor:
    """The value of buffer ``name`` (shaped like ``want``) from the nearest config-built module."""
    owner = name.rpartition(".")[0]
    reasons = []
    for prefix in _ancestors(owner):
        found = builds.buffers(prefix)
        if isinstance(found, str):
            reasons.append(found)
            continue
        local = name[len(prefix) + 1:] if prefix else name
        value = found.get(local)
        if value is not None and tuple(value.shape) == tuple(want.shape):
            return value
        built = type(builds.model.get_submodule(prefix)).__name__
        reasons.append(f"{built}(config) does not compute it the same on two builds (random?)"
                       if value is None else f"{built}(config) gives it shape "
                       f"{tuple(value.shape)}, the model {tuple(want.shape)}")
        break  # built from its config: its parents would compute the same
    raise TPCompileError(
        f"non-persistent buffer {name} was built on the meta device and is in no state dict, "
        f"and it is not recomputable from the model's config ({'; '.join(reasons)})\n  hint: "
        "pass buffers=tpcompile.buffers_of(lambda: MyModel(cfg)) (re-runs the constructor with "
        "parameters on meta) or a dict of them")


def config_buffers(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Full values of the non-persistent buffers ``names`` of ``model`` (a meta model), on CPU,
    recomputed by building their modules from their configs (see the module docstring)."""
    builds = _Builds(model)
    return {name: _one(builds, name, model.get_buffer(name)) for name in names}
