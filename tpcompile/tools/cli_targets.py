"""What the command line inspects: a built-in model or ``MODULE:FACTORY``, and its inputs.

``MODULE`` is a dotted module name or a path to a ``.py`` file; ``FACTORY`` is called with no
arguments and returns a model, or ``(model, example_inputs)``. Example inputs come from, in
order: ``--input-shape`` (token ids if the model has an ``nn.Embedding``, else zeros in the
parameters' dtype; values do not matter, capture traces shapes only), the factory's own
inputs, or for the built-in models ``(batch 2, sequence 16)``. With ``meta=True`` the model is
built on the meta device, so a 7B-shaped model is planned without allocating its weights.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tpcompile.tools import models

__all__ = ["UsageError", "Target", "load_target", "parse_shape", "parse_config"]

BUILTIN_SHAPE = (2, 16)


class UsageError(Exception):
    """A command-line mistake: one line saying what is wrong, one saying what to do.

    ``exit_code`` is 2 for misuse of the command, 1 when the user's own factory fails.
    """

    def __init__(self, message: str, hint: str, exit_code: int = 2):
        super().__init__(message)
        self.message, self.hint, self.exit_code = message, hint, exit_code


@dataclass
class Target:
    model: nn.Module
    inputs: tuple
    label: str


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--input-shape {text!r} is not a list of positive sizes",
                         "write it as comma-separated integers, e.g. --input-shape 2,128")
    return shape


def parse_config(text: str | None) -> dict:
    """'dim=4096,n_layers=32,sdpa=false' -> overrides of the built-in models' ModelConfig."""
    fields = {f.name: f.type for f in dataclasses.fields(models.ModelConfig)}
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise UsageError(f"--config item {item!r} is not KEY=VALUE with a known key",
                             f"keys: {', '.join(fields)}")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif value.isdigit():
            out[key] = int(value)
        else:
            raise UsageError(f"--config {key}={value}: expected an integer or true/false",
                             "e.g. --config dim=4096,n_layers=32,fused_qkv=true")
    return out


def _builtin(name: str, shape, overrides: dict, meta: bool) -> Target:
    if shape is not None and len(shape) != 2:
        raise UsageError(f"built-in model {name} takes --input-shape BATCH,SEQ, got {len(shape)} sizes",
                         "e.g. --input-shape 2,128")
    batch, seq = shape or BUILTIN_SHAPE
    cls, cfg = models.MODELS[name]
    if seq > cfg.max_seq and "max_seq" not in overrides:
        overrides = {**overrides, "max_seq": seq}  # position tables must cover the sequence
    if meta:
        with torch.device("meta"):
            model = cls(dataclasses.replace(cfg, **overrides))
    else:
        model = models.build(name, **overrides)
    inputs = tuple(x.to(_device(model)) for x in models.example_inputs(model, batch, seq))
    return Target(model, inputs, name)


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _import(module: str):
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise UsageError(f"no such file: {module}", "give a path to a .py file or a dotted module")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UsageError(f"cannot import module {module!r}: {e}",
                         "run from the directory that holds it, or give a file path: "
                         "path/to/models.py:factory") from e


def _synthetic_inputs(model: nn.Module, shape) -> tuple:
    device = _device(model)
    if any(isinstance(m, nn.Embedding) for m in model.modules()):
        return (torch.zeros(shape, dtype=torch.long, device=device),)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return (torch.zeros(shape, dtype=dtype, device=device),)


def load_target(spec: str, input_shape=None, config: dict | None = None, meta: bool = False) -> Target:
    """Build the model ``spec`` names and example inputs for it (see the module docstring)."""
    if spec in models.MODELS:
        return _builtin(spec, input_shape, config or {}, meta)
    if config:
        raise UsageError("--config applies to the built-in models only",
                         f"built-in models: {', '.join(sorted(models.MODELS))}")
    module, _, factory_name = spec.rpartition(":")
    if not module or not factory_name:
        raise UsageError(f"{spec!r} is neither a built-in model nor MODULE:FACTORY",
                         f"use one of {', '.join(sorted(models.MODELS))}, or e.g. my_models.py:build")
    factory = getattr(_import(module), factory_name, None)
    if not callable(factory):
        raise UsageError(f"{module} has no function {factory_name!r}",
                         f"define `def {factory_name}():` returning a model or (model, example_inputs)")
    try:
        with torch.device("meta") if meta else nullcontext():
            made = factory()
    except Exception as e:  # noqa: BLE001 - the user's code: report it in one line
        raise UsageError(f"{spec}() raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                         "the factory must build the model when called with no arguments",
                         exit_code=1) from e
    model, inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec} returned {type(made).__name__}, not an nn.Module",
                         "return the model, or a pair (model, example_inputs)")
    if input_shape is not None:
        inputs = _synthetic_inputs(model, input_shape)
    if inputs is None:
        raise UsageError(f"no example inputs for {spec}",
                         "pass --input-shape 2,128 (token ids if the model has an nn.Embedding, "
                         "float otherwise) or return (model, example_inputs) from the factory")
    return Target(model, inputs if isinstance(inputs, tuple) else (inputs,), spec)
