"""The error measures every numerics test and sweep reads (tpcompile.tools.numerics)."""

from __future__ import annotations

import torch

from tpcompile.tools.numerics import grad_errors, rel_err


def test_rel_err_is_relative_to_the_reference_or_its_floor():
    ref = torch.tensor([2.0, -4.0])
    assert rel_err(torch.tensor([2.0, -3.0]), ref) == 0.25
    assert rel_err(torch.tensor([0.25, 0.0]), torch.zeros(2), floor=2.0) == 0.125


def test_an_empty_gradient_is_measured_not_raised():
    """A parameter with no elements (a tiny config's MLP of hidden size 0, diffusers'
    NucleusMoE) has an empty gradient: error 0 against an empty one, and the floor comes from
    the other gradients (``max()`` of an empty tensor raised and lost the model's row)."""
    reference = {"empty": torch.zeros(0, 4), "w": torch.tensor([[1.0, 0.0]])}
    grads = {"empty": torch.zeros(0, 4), "w": torch.tensor([[1.0, 2.0**-10]])}
    errs = grad_errors(grads, reference)
    assert errs == {"empty": 0.0, "w": 2.0**-10}
    assert rel_err(torch.zeros(4, 0), torch.zeros(0, 4)) == float("inf")
