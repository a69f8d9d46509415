"""One rank's grouped matmul over its whole experts: only the rows routed to them.

A grouped matmul (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``) multiplies the
rows of ``x`` (sorted by expert) group by group: the rows of expert ``e`` end at ``offs[e]``.
Under ``experts="expert"`` a rank holds experts ``[first, last)`` only
(``passes/planner/experts/grouped.py``). Where their rows start and end depends on this step's
routing, so it is read from the offsets at run time (one host read per call): the rank
multiplies those rows by its experts, with offsets made relative to their first row, and
returns a tensor of every row, zero outside them. Summed over the ranks those are the whole
output, which is why the block's result is a partial sum, all-reduced once. Autograd runs
through the slice and the pad: the rows of other experts get a zero gradient on this rank.
On the meta device (``advise`` measuring a plan) there are no offsets to read: the rank's
rows are its experts' uniform share, the shapes the expected routing gives.
Under ``torch.compile`` the read bounds are data-dependent sizes; the function states their
range (``torch._check``) and slices with ``narrow`` (no clamping of the bounds), so inductor
compiles the slice, the pad and their backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm_rows"]


def grouped_mm_rows(grouped, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                    first: int, last: int, **kwargs) -> torch.Tensor:
    """``grouped(x, w_all, offs, **kwargs)`` restricted to experts ``[first, last)``, whose
    weights ``w`` (``last - first`` of them) this rank holds: their rows computed, every
    other row zero. ``offs`` holds the cumulative row counts of every expert."""
    if offs.device.type == "meta":  # no routing to read: the experts' uniform share of rows
        start, end = x.shape[0] * first // len(offs), x.shape[0] * last // len(offs)
    else:
        bounds = offs[max(first - 1, 0):last].tolist()
        start = bounds[0] if first > 0 else 0
        end = bounds[-1]
    # read from a tensor, the bounds are unbacked sizes under torch.compile: state what the
    # offsets guarantee, so the slice and pad (and their backward) need no guard on them
    torch._check(start >= 0)
    torch._check(start <= end)
    torch._check(end <= x.shape[0])
    local = grouped(x.narrow(0, start, end - start), w, offs[first:last] - start, **kwargs)
    return F.pad(local, (0, 0, start, x.shape[0] - end))
