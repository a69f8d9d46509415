"""One rank's grouped matmul over its whole experts (``grouped_mm_rows``), for any routing.

Experts cut over 2, 3 and 4 ranks (uneven included) under routings with empty experts, every
row on one expert, rows past the last offset (transformers' expert-parallel sentinels) and
random counts: summed over the ranks the outputs equal the whole grouped matmul, and so do the
gradients of the rows; each rank's weight gradient equals the whole weight gradient's rows of
its experts. Both grouped ops transformers calls are checked: ``aten._grouped_mm`` and its
``grouped_mm_fallback``.
"""

from __future__ import annotations

import pytest
import torch

from tpcompile.runtime.routed_rows import grouped_mm_rows

EXPERTS, K, N = 6, 8, 8
COUNTS = {  # rows per expert, and rows past the last offset
    "random": ([3, 1, 4, 1, 5, 2], 0),
    "empty_experts": ([0, 4, 0, 0, 7, 0], 0),
    "one_expert": ([0, 0, 0, 9, 0, 0], 0),
    "first_and_last": ([5, 0, 0, 0, 0, 6], 0),
    "sentinel_tail": ([2, 2, 0, 3, 1, 1], 3),
}


def _ops():
    import transformers.integrations.moe  # noqa: F401 - registers transformers::grouped_mm_fallback
    return {"aten": torch._grouped_mm, "fallback": torch.ops.transformers.grouped_mm_fallback}


def _split(n: int, ranks: int) -> list[tuple[int, int]]:
    """``torch.tensor_split``'s counts, as RootSpec cuts experts: the first ranks one more."""
    q, extra = divmod(n, ranks)
    bounds = [0]
    for r in range(ranks):
        bounds.append(bounds[-1] + q + (r < extra))
    return list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("op", ["aten", "fallback"])
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ranks_sum_to_the_whole_grouped_matmul(op, routing, ranks):
    grouped = _ops()[op]
    counts, tail = COUNTS[routing]
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = sum(counts) + tail
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, K, generator=gen, requires_grad=True)
    w = torch.randn(EXPERTS, K, N, generator=gen, requires_grad=True)
    probe = torch.randn(rows, N, generator=gen)
    probe[sum(counts):] = 0  # rows past the last offset are no expert's: nobody reads them
    whole = grouped(x, w, offs)
    x_grad, w_grad = torch.autograd.grad((whole * probe).sum(), (x, w))
    total, x_total = torch.zeros_like(whole), torch.zeros_like(x)
    for first, last in _split(EXPERTS, ranks):
        mine = w.detach()[first:last].clone().requires_grad_()
        xr = x.detach().clone().requires_grad_()
        out = grouped_mm_rows(grouped, xr, mine, offs, first, last)
        (out * probe).sum().backward()
        total += out.detach()
        x_total += xr.grad
        torch.testing.assert_close(mine.grad, w_grad[first:last], rtol=1e-5, atol=1e-5)
    live = sum(counts)
    torch.testing.assert_close(total[:live], whole.detach()[:live], rtol=1e-5, atol=1e-5)
    assert not total[live:].any()  # past the last offset: zero, on every rank
    # the whole op leaves its gradient past the last offset unset (aten's kernel): ours is zero
    torch.testing.assert_close(x_total[:live], x_grad[:live], rtol=1e-5, atol=1e-5)
    assert not x_total[live:].any()
