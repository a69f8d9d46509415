"""A max over a cut row (passes/planner/rules/extrema.py): a max partial, all-reduced by max.

Plans only, no process group, on an MLP that fake-quantizes the input of its row-parallel
linear per token (the scale from its row's largest magnitude, as torchao's symmetric dynamic
activation quantization; an asymmetric one takes the min and the max apart). Frozen (token
ids in, so no gradient reaches it), the row is cut and its extremum all-reduced (one for the
largest magnitude, two for min and max), at the bound the model gives; trainable, the max's
gradient would need the whole row, so it is gathered as before. torchao's configs on gloo ranks: ``tests/gloo/test_quant.py``.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.core.placement import Partial, Replicate
from tpcompile.core.plan import placement_from_json, placement_to_json


class QuantizedMLP(nn.Module):
    """``down(quantize(silu(up(embed(ids)))))``, the quantization per token over the whole row
    (token ids in: no gradient reaches a frozen model)."""

    def __init__(self, dim: int = 32, hidden: int = 64, symmetric: bool = True):
        super().__init__()
        self.embed = nn.Embedding(100, dim)
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.symmetric = symmetric

    def forward(self, ids):
        h = torch.nn.functional.silu(self.up(self.embed(ids)))
        low = torch.minimum(h.amin(-1, keepdim=True), torch.zeros(1))
        high = torch.maximum(h.amax(-1, keepdim=True), torch.zeros(1))
        if self.symmetric:
            scale = torch.maximum(-low, high) / 127.5
            zero = torch.zeros_like(scale)
        else:
            scale = (high - low) / 255.0
            zero = -128 - torch.round(low / scale)
        q = torch.clamp(torch.round(h / scale) + zero, -128, 127)
        return self.down((q - zero) * scale)


IDS = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))


def _forward(report) -> collections.Counter:
    return collections.Counter(c.op for c in report.collectives if c.phase == "forward")


def _verdict(report) -> str:
    return next(line for line in str(report).splitlines() if line.strip().startswith("-> "))


@pytest.mark.parametrize("symmetric, extrema", [(True, 1), (False, 2)])
@pytest.mark.parametrize("ws", [2, 4])
def test_a_frozen_rows_extremum_is_all_reduced_and_its_matmuls_cut(symmetric, extrema, ws):
    model = QuantizedMLP(symmetric=symmetric).requires_grad_(False)
    report = tpcompile.explain(model, (IDS,), ws)
    assert (report.params["up.weight"].style, report.params["down.weight"].style) == (
        "colwise", "rowwise")
    assert _forward(report) == {"all_reduce": 1 + extrema}
    assert _verdict(report).strip().startswith("-> at the bound")


def test_a_trainable_rows_extremum_gathers_the_row():
    """A max's gradient goes to its argmax, and torch splits a tie among the whole row: with a
    gradient through it, the row is not cut (the chain stays whole, named)."""
    report = tpcompile.explain(QuantizedMLP(), (IDS,), 2)
    assert report.params["down.weight"].style == "replicate"
    assert "would all-gather where" in report.params["up.weight"].reason


def test_a_max_partial_round_trips_through_the_plans_json():
    for p in (Partial(), Partial("max"), Partial("min"), Replicate()):
        assert placement_from_json(placement_to_json(p)) == p
    assert str(Partial("max")) == "P(max)" and str(Partial()) == "P"
