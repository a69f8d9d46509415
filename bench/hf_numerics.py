"""The Hugging Face sweep's numerics (bench/hf_sweep.py): a family's logits and every gradient
on 2 gloo ranks against the unsharded model, in float32, and a float32 miss again in float64.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Callable

from bench.hf_configs import build, example_ids, first_line

WORLD_SIZE = 2
NUMERICS_TIMEOUT_S = 240
TOLERANCE = 1e-5
DOUBLE_TOLERANCE = 1e-10


def _numerics_rank(rank: int, world_size: int, name: str, mode: str,
                   double: bool = False) -> dict:
    import torch

    import tpcompile
    from tpcompile.tools.numerics import compare

    torch.set_num_threads(1)
    if double:
        keep_float64_through_float32_casts()
    model, ids = build(name, mode), example_ids()
    with torch.no_grad():  # the call `_measure` makes before planning: BigBird picks its
        model(ids)         # attention for the sequence length there, assigning modules
    if double:
        model.double()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = compare(model, tpcompile.parallelize(model, (ids,)), (ids,))
    except Exception as e:  # noqa: BLE001
        # the whole text too: a PlanMismatchError names each rank's differing entry below line 1
        return {"error": first_line(e), "detail": str(e)[:2000]}
    worst = max(c.grad_errs.items(), key=lambda kv: kv[1]) if c.grad_errs else ("", 0.0)
    return {"output_err": c.output_err, "max_grad_err": worst[1], "worst_grad": worst[0]}


def keep_float64_through_float32_casts() -> None:
    """Make the model's hard-coded float32 casts keep float64 tensors float64 (this rank only).

    Some families cast to float32 inside the block whatever the model's dtype (Gemma 4:
    ``q_proj(x).float()`` and ``softmax(..., dtype=torch.float32)``), so a float64 run would
    still round there, and sharded-vs-unsharded would differ by float32 rounding (1e-6), far
    above the float64 bar; diffusers' Kandinsky 5 casts its timestep with
    ``time.to(torch.float32)`` and then met a float64 linear. ``Tensor.float()``,
    ``Tensor.to(torch.float32)`` and ``softmax``'s ``dtype=float32`` leave a float64 tensor as
    it is; everything else runs unchanged (so the process may keep it: a second call does
    nothing).
    """
    import torch
    import torch.nn.functional as F

    if getattr(torch.Tensor.float, "keeps_float64", False):
        return
    to_float32, to, softmax = torch.Tensor.float, torch.Tensor.to, F.softmax

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float32(self, *args, **kwargs)

    def to_(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def softmax_(input, dim=None, _stacklevel=3, dtype=None):
        return softmax(input, dim=dim, dtype=None if input.dtype == torch.float64 else dtype)

    float_.keeps_float64 = True
    torch.Tensor.float, torch.Tensor.to, F.softmax = float_, to_, softmax_


def run_numerics(name: str, mode: str) -> dict:
    """Logits and every gradient on 2 gloo ranks against the unsharded model, in float32, and
    a float32 miss again in float64 (:func:`float64_retry`)."""
    return float64_retry(lambda double: _numerics_on_ranks(name, mode, double),
                         lambda: float32_rounding(build(name, mode), (example_ids(),)))


def float64_retry(run: Callable[[bool], dict], rounding: Callable[[], float]) -> dict:
    """``run(False)``'s float32 errors, and for a miss ``run(True)``'s in float64.

    A plan that is exact in float64 (<= 1e-10) differs only in float32 rounding, which some
    models amplify beyond the 1e-5 bar (CpmAnt: its unsharded float32 gradients are 9e-5 off
    its own float64 ones; a UNet's conv biases sum a whole feature map). The row keeps both
    numbers and ``rounding()``, the unsharded model's float32-vs-float64 error, as the
    yardstick. In the float64 run the model's own float32 casts keep float64
    (``keep_float64_through_float32_casts``)."""
    result = run(False)
    if "error" in result or result["exact"]:
        return result
    again = run(True)
    if "error" in again:  # the miss stands, with why float64 could not judge it
        return {**result, "float64_error": again["error"]}
    return {**result, "float64_grad_err": again["max_grad_err"], "float32_rounding": rounding(),
            "exact": max(again["output_err"], again["max_grad_err"]) <= DOUBLE_TOLERANCE}


def as_dtype(inputs: tuple, dtype) -> tuple:
    """``inputs`` with their floating-point tensors in ``dtype`` (token ids stay integers)."""
    import torch

    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                 for x in inputs)


def float32_rounding(model, inputs: tuple) -> float:
    """The unsharded model's own float32 gradients against its float64 ones (same measure),
    the float64 run keeping float64 through the model's float32 casts as the ranks' does."""
    import copy

    import torch

    from tpcompile.tools.numerics import _loss, grad_errors

    keep_float64_through_float32_casts()

    def grads(dtype):
        m = copy.deepcopy(model).to(dtype)
        _loss(m(*as_dtype(inputs, dtype))).backward()
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    return max(grad_errors(grads(torch.float32), grads(torch.float64)).values())


def _numerics_on_ranks(name: str, mode: str, double: bool = False) -> dict:
    return on_ranks(f"{Path(__file__).resolve()}:_numerics_rank", name, mode, double)


def on_ranks(body: str, *args) -> dict:
    """``body`` (``path:function`` returning one rank's errors) on ``WORLD_SIZE`` gloo ranks:
    the worst rank's errors (:func:`worst_of`), or the error a rank raised."""
    from tpcompile.tools.launch import run_on_ranks

    try:
        per_rank = run_on_ranks(body, WORLD_SIZE, *args, timeout=NUMERICS_TIMEOUT_S - 20)
    except Exception as e:  # noqa: BLE001 - the failure is the row's numerics cell
        return {"error": rank_error(e)}
    return worst_of(per_rank)


def rank_error(e: BaseException) -> str:
    """A failed launch's message: the last exception line of a rank's traceback."""
    raised = [ln for ln in str(e).splitlines() if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    return raised[-1][:300] if raised else first_line(e)


def worst_of(per_rank: list[dict], tolerance: float = TOLERANCE) -> dict:
    """The first rank's error, else the largest output error, the worst gradient rank's
    measurements (``max_grad_err``, ``worst_grad``, ...) and whether both are within
    ``tolerance``."""
    failed = [r for r in per_rank if "error" in r]
    if failed:
        return failed[0]
    out = max(r["output_err"] for r in per_rank)
    worst = max(per_rank, key=lambda r: r["max_grad_err"])
    return {**worst, "output_err": out, "exact": max(out, worst["max_grad_err"]) <= tolerance}
