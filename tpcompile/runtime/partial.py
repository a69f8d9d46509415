"""Local halves of reductions whose results the ranks sum: each rank's term of the whole.

A mean over a dim cut across ranks is linear in its input, so it need not gather the input:
each rank sums its own slice and divides by the *whole* dim's size, and the ranks' results
add up to the mean (``explain`` shows it as a Partial placement; the planner all-reduces it
where a non-linear op reads it). A norm over a projection split by heads (OLMo's q/k norm over
all heads) thus costs an all-reduce of one number per token instead of a gather of the
projection.
"""

from __future__ import annotations

import torch

__all__ = ["mean_term"]


def mean_term(x: torch.Tensor, dims: list[int], keepdim: bool, whole: int, dtype=None) -> torch.Tensor:
    """This rank's term of a mean over ``dims`` whose elements number ``whole`` in all."""
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype) / whole
