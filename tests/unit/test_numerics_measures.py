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


class _RandomLabelDrop(torch.nn.Module):
    """A DiT's class-label dropout in train mode: every call draws which labels to drop."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(5, 4)

    def forward(self, labels):
        dropped = torch.rand(labels.shape[0]) < 0.5
        return self.table(torch.where(dropped, torch.full_like(labels, 4), labels))


class _Same(torch.nn.Module):
    """A stand-in for a parallelized module: the same model, its gradients as they are."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.graph_module = torch.fx.symbolic_trace(torch.nn.Identity())  # no collective

    def forward(self, *args):
        return self.model(*args)

    def full_grads(self):
        return {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}

    def full_state_dict(self):
        return self.model.state_dict()


def test_compare_gives_both_models_the_same_random_draws():
    """The reference and the parallelized model see the same random numbers, in the first call
    and in each step: a DiT's class-label dropout read as a mismatch of 0.6 when the second
    call drew other labels (it matched only when the draws happened to agree)."""
    from tpcompile.tools.numerics import compare

    torch.manual_seed(3)
    model = _RandomLabelDrop()
    c = compare(model, _Same(model), (torch.arange(4),), steps=2)
    assert c.output_err == 0.0 and max(c.grad_errs.values()) == 0.0
