"""A CPU kernel for integer ``torch.histc``, so torchtitan's MoE routers run on CPU unchanged.

torchtitan's ``TokenChoiceTopKRouter`` and ``TokenReorderer`` count the tokens each expert
receives with ``torch.histc`` on the int64 expert indices. PyTorch has that kernel only on CUDA:
on CPU it raises ``"histogram_cpu" not implemented for 'Long'``, so no torchtitan MoE model
(DeepSeek-V3, qwen3-moe, llama4) runs unsharded here, let alone on gloo ranks. :func:`install`
replaces ``aten::histc``'s CPU kernel, for the process, with one that bins through
``torch.histogram`` with histc's semantics: ``bins`` equal-width bins over ``[min, max]``, a
value equal to ``max`` in the last bin, values outside ignored, and ``min == max`` meaning the
data's own range (widened by 1 each side when that is empty); the counts come back in the
input's dtype, as histc's do. Integers are binned in float64, which holds every index exactly.

This is a bench / test shim, not part of tpcompile: tpcompile plans ``aten.histc`` by its rule
(passes/planner/rules/table.py) whatever kernel runs it. The bench (bench/upstream_models.py)
and the tests that build torchtitan-style routers call :func:`install`; it is idempotent.
"""

from __future__ import annotations

import torch
import torch._decomp

_LIBRARY: torch.library.Library | None = None


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002 - aten's names
    """``torch.histc(x, bins, min, max)`` for any real dtype on CPU (see the module docstring)."""
    exact = x if x.dtype in (torch.float32, torch.float64) else x.double()
    lo, hi = float(min), float(max)
    if lo == hi and exact.numel():
        lo, hi = exact.min().item(), exact.max().item()
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError(f"histc: max must be larger than min, got min={min} max={max}")
    counts = torch.histogram(exact.reshape(-1), bins=bins, range=(lo, hi)).hist
    return counts.to(x.dtype)


def _histc_meta(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    """histc's shape and dtype (``(bins,)``, the input's), for capture: PyTorch's own meta
    kernel refuses a CPU integer input because the CPU kernel used to."""
    return x.new_empty((bins,))


def install() -> None:
    """Register :func:`histc` as ``aten::histc``'s CPU kernel, and a meta kernel that accepts
    integers, for this process (once)."""
    global _LIBRARY
    if _LIBRARY is None:
        import warnings

        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            library.impl("histc", histc, "CPU")
            library.impl("histc", _histc_meta, "Meta")
        op = torch.ops.aten.histc.default  # capture reads the Python meta kernel, not the C++ one
        op.py_kernels[torch._C.DispatchKey.Meta] = _histc_meta
        torch._decomp.meta_table[op] = _histc_meta
        op._dispatch_cache.clear()
        _LIBRARY = library
