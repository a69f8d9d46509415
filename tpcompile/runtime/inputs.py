"""Check a parallelized module's call against the example call it was captured from.

The graph was traced for inputs of the example's structure, ranks and dtypes; sizes were kept
symbolic except those the model fixes (a feature width) and those of size 0 or 1 in the example
(export specialises them). Another input would fail deep inside the graph with an unrelated
message (``IndexError: tuple index out of range``), or, for a dtype, silently compute in
another precision than the model would. :class:`InputSpec` turns each into an
:class:`InputError` that names the input and says how to fix the call.

Two limits come from the model rather than the example, and are checked too, with the limit and
its origin in the message: the range export kept for a symbolic size (``tokens.size()[1] <= 64``
where the model slices a 64-row position table by the sequence length; its graph would stop on
a bare ``AssertionError: Guard failed``), and the rows of an embedding table indexed by an input
(torch's bare ``IndexError: index out of range in self`` on CPU, a device-side assert that
poisons the CUDA context on GPUs). Everything here is local: it runs before the call agreement
(:mod:`tpcompile.runtime.calls`) and any collective.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx import _pytree as fx_pytree

from tpcompile.errors import InputError
from tpcompile.runtime.limits import TokenTable, check_tokens, dim_limits, token_tables

__all__ = ["InputSpec"]


def _show(dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(str(s) for s in shape)}]"


def _fixed(size) -> int | None:
    """The size when capture fixed it (a model constant, or specialised by export), else None."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else None
    return int(size)


@dataclass(frozen=True)
class _Expected:
    name: str
    dtype: torch.dtype
    shape: tuple  # ints where the graph fixed the size, None where it is symbolic
    limits: tuple = ()  # per dim: a Limit (the range export kept for a symbolic size) or None


@dataclass(frozen=True)
class InputSpec:
    """What each input placeholder of a captured graph accepts."""

    signature: inspect.Signature
    in_spec: object
    expected: tuple  # per flat input: _Expected, or None for non-tensor inputs
    tables: tuple[TokenTable, ...] = ()  # embedding tables indexed by an input's values

    @staticmethod
    def of(gm: fx.GraphModule) -> "InputSpec":
        expected = []
        for node in gm.graph.find_nodes(op="placeholder"):
            v = node.meta.get("val")
            expected.append(_Expected(node.name, v.dtype, tuple(map(_fixed, v.shape)),
                                      dim_limits(gm, node))
                            if isinstance(v, torch.Tensor) else None)
        return InputSpec(inspect.signature(gm.forward), gm._in_spec, tuple(expected),
                         token_tables(gm))

    def check(self, args: tuple, kwargs: dict) -> list:
        """Raise an :class:`InputError` for a call the graph cannot run; the flat inputs."""
        flat = self._flatten(args, kwargs)
        for want, got in zip(self.expected, flat):
            if want is not None:
                _check_one(want, got)
        for want, got in zip(self.expected, flat):  # ranks, dtypes and fixed sizes first
            for d, limit in enumerate(want.limits if want is not None else ()):
                if limit is not None:
                    limit.check(want.name, d, got.shape[d])
        check_tokens(self.tables, flat)
        return flat

    def _flatten(self, args, kwargs) -> list:
        try:
            bound = self.signature.bind(*args, **kwargs)
            names = list(self.signature.parameters)
            n_args = self.in_spec.child(0).num_children
            positional = [bound.arguments.get(n) for n in names[:n_args]]
            keywords = {n: bound.arguments.get(n) for n in names[n_args:]}
            flat = fx_pytree.tree_flatten_spec((positional, keywords), self.in_spec)
        except (TypeError, ValueError, RuntimeError, AssertionError) as e:
            raise InputError(
                f"the call's inputs do not have the example call's structure ({e}); the module "
                f"accepts {self.signature}\n  hint: pass the same positional and keyword tensors "
                "as the example inputs") from e
        if len(flat) != len(self.expected):
            raise InputError(f"the call has {len(flat)} inputs, the example call had "
                             f"{len(self.expected)}; the module accepts {self.signature}")
        return flat


def _check_one(want: _Expected, got) -> None:
    example = _show(want.dtype, ["?" if s is None else s for s in want.shape])
    hint = ("\n  hint: the module was captured for inputs like the example's; call parallelize "
            "again with example inputs of this form")
    if not isinstance(got, torch.Tensor):
        raise InputError(f"input {want.name}: expected a tensor like the example's {example}, "
                         f"got {type(got).__name__}{hint}")
    shown = _show(got.dtype, got.shape)
    if got.dim() != len(want.shape):
        raise InputError(f"input {want.name}: expected {len(want.shape)} dims like the example's "
                         f"{example}, got {got.dim()} dims: {shown}{hint}")
    if got.dtype != want.dtype:
        raise InputError(f"input {want.name}: expected dtype {str(want.dtype).removeprefix('torch.')} "
                         f"like the example's {example}, got {shown}{hint}")
    for d, size in enumerate(want.shape):
        if size is not None and got.shape[d] != size:
            raise InputError(
                f"input {want.name}: dim {d} must be {size} like the example's {example} (fixed "
                f"at capture: the model fixes it, or the example had size 0 or 1 there), got "
                f"{shown}{hint}")
