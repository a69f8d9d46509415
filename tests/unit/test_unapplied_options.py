"""Every option that does nothing says so: a ``tpcompile:`` warning and a plan note, naming the
option and why (issue #44: never silent). Planned on one process, no process group."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tpcompile

from tpcompile.api import plan_model
from tpcompile.passes.planner.unapplied_options import unapplied_checkpointing
from tpcompile.tools import models


def _plan(model, inputs, **options):
    """(plan, the tpcompile warnings planning gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, plan = plan_model(model, inputs, 2, **options)
    said = [str(w.message) for w in caught if str(w.message).startswith("tpcompile: ")]
    return plan, said


def _said(plan, said: list, option: str, why: str) -> None:
    """``option`` is named, with ``why``, in exactly one warning and one note."""
    notes = [n for n in plan.notes if n.startswith(f"{option} did not apply: ")]
    assert len(notes) == 1 and why in notes[0], plan.notes
    assert said.count(f"tpcompile: {notes[0]}") == 1, said
    assert f"note: {notes[0]}" in str(plan)  # printed with the plan


def _built(name: str, **options):
    model = models.build(name)
    return _plan(model, models.example_inputs(model), **options)


def test_vocab_parallel_cuts_a_tied_table_without_a_sharded_loss_and_says_nothing():
    plan, said = _built("gpt2", vocab_parallel=True)  # the whole logits are gathered
    assert plan.by_fqn["wte.weight"].style == "vocab"
    assert not any("did not apply" in n for n in plan.notes) and not said


def test_vocab_parallel_with_a_sharded_loss_cuts_the_tied_table_and_says_nothing():
    plan, said = _built("gpt2", vocab_parallel=True, loss_parallel=True)
    assert plan.by_fqn["wte.weight"].style == "vocab"
    assert not any("did not apply" in n for n in plan.notes) and not said


def test_vocab_parallel_without_an_embedding():
    plan, said = _built("mlp", vocab_parallel=True)
    _said(plan, said, "vocab_parallel=True", "no embedding table looked up by token ids")


def test_loss_parallel_without_a_sharded_output():
    plan, said = _built("mlp", loss_parallel=True)
    assert not plan.output_layouts()
    _said(plan, said, "loss_parallel=True", "no output of the model is sharded")


class NoChain(nn.Module):
    """One linear after a norm: its column cut would reach the output whole, so no chain."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(self.norm(x))


def test_sequence_parallel_on_a_model_with_no_chain():
    plan, said = _plan(NoChain(), (torch.randn(2, 8, 16),), sequence_parallel=True)
    assert {e.style for e in plan.params.values()} == {"replicate"}
    _said(plan, said, "sequence_parallel=True", "no column -> row chain")


def test_sequence_parallel_on_a_model_with_chains_says_nothing():
    plan, said = _built("mlp", sequence_parallel=True)
    assert not any("did not apply" in n for n in plan.notes) and not said


@pytest.mark.parametrize("mode", ["expert", "auto"])
def test_experts_on_a_model_without_experts(mode):
    plan, said = _built("mlp", experts=mode)
    _said(plan, said, f"experts={mode!r}", "no stacked or looped expert weights")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_that_finds_no_block(mode):
    """``explain`` reports what ``parallelize`` announces after outlining the rank graph."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tpcompile.explain(NoChain(), (torch.randn(2, 8, 16),), world_size=2,
                                   activation_checkpointing=mode)
    note, = [n for n in report.notes if n.startswith(f"activation_checkpointing={mode!r}")]
    assert "did not apply: no repeated blocks" in note
    assert f"tpcompile: {note}" in [str(w.message) for w in caught]
    assert f"note: {note}" in str(report)
    assert unapplied_checkpointing(mode, ["layers.0"], []) == []  # a block found: nothing said
