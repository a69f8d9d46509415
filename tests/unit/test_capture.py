"""Capture errors name the construct and the way out; meta example inputs are accepted."""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import pytest
import torch
from torch import nn

from tpcompile import CaptureError

from tpcompile.tools import models
from tpcompile.core.capture import capture


class DataDependentIf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # the line the error must name
            return self.fc(x)
        return x


def test_data_dependent_python_if_is_named():
    with pytest.raises(CaptureError) as e:
        capture(DataDependentIf(), (torch.randn(2, 4),))
    msg = str(e.value)
    assert "data-dependent control flow" in msg
    assert "if x.sum() > 0" in msg and "test_capture.py" in msg
    assert "torch.cond" in msg


class LengthsFromAMask(nn.Module):
    """Lumina 2's rotary embedder: lengths read from a mask's values, then hashed."""

    def forward(self, x, mask):
        lengths = mask.sum(dim=1).tolist()
        if len(set(lengths)) > 1:  # the line the error must name
            return x * 2
        return x


def test_an_error_without_a_blamed_line_names_the_models_own():
    """Export's TypeError (a length read from a tensor is no hashable int) names no model
    line; the innermost line of the model's code in the traceback is named instead."""
    with pytest.raises(CaptureError) as e:
        capture(LengthsFromAMask(), (torch.randn(2, 4), torch.ones(2, 3, dtype=torch.long)))
    msg = str(e.value)
    assert "test_capture.py" in msg and "len(set(lengths))" in msg and "unhashable" in msg


def test_inputs_must_be_a_tuple():
    with pytest.raises(CaptureError, match="tuple of tensors"):
        capture(models.build("mlp"), {"x": torch.randn(2, 3, 64)})


def test_meta_example_inputs_and_fqns():
    model = models.build("gpt2")
    cap = capture(model, (torch.empty(2, 16, dtype=torch.long, device="meta"),))
    assert "blocks.0.attn.c_attn.weight" in cap.params
    # tied weights: one tensor, both names
    assert set(cap.aliases["lm_head.weight"]) == {"wte.weight", "lm_head.weight"}


def test_parallelize_without_a_process_group_is_a_clear_error():
    import tpcompile

    with pytest.raises(tpcompile.MeshError, match="init_process_group"):
        tpcompile.parallelize(models.build("mlp"), models.example_inputs(models.build("mlp")))


def test_a_batch_of_one_is_said_to_fix_the_batch_size():
    model = models.build("mlp")
    with pytest.warns(UserWarning, match="input x has size 1 at dim 0: export fixes it"):
        cap = capture(model, (torch.randn(1, 8, 64),))
    assert cap.notes == ("input x has size 1 at dim 0: export fixes it, so the module accepts "
                         "only 1 there; give an example with size >= 2 to keep it dynamic",)
    assert capture(model, (torch.randn(2, 8, 64),)).notes == ()


def test_export_does_not_also_log_the_fixed_size(caplog):
    """torch.export's own "0/1 specialized" warning speaks of the Dim.AUTO capture chose; the
    note above says it with the way out, once (a decode step's capture printed it per rank)."""
    with pytest.warns(UserWarning, match="export fixes it"):
        capture(models.build("mlp"), (torch.randn(1, 1, 64),))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


class Lengths(NamedTuple):
    """An input of torchtitan's kind (its varlen attention's ``VarlenMetadata``)."""
    starts: torch.Tensor
    scale: torch.Tensor


class ReadsANamedTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, lengths: Lengths):
        return self.fc(x) * lengths.scale + lengths.starts.sum()


def test_a_named_tuple_input_is_captured_with_its_dims_dynamic():
    """Every dim of a NamedTuple's tensors dynamic, as for a plain tuple (export's dynamic
    shapes spec rebuilt a NamedTuple from one iterable, a TypeError)."""
    model, x = ReadsANamedTuple(), torch.randn(2, 3, 4)
    lengths = Lengths(torch.arange(3.0), torch.full((2, 3, 1), 0.5))
    cap = capture(model, (x,), {"lengths": lengths})
    assert torch.allclose(cap.gm(x, lengths=lengths), model(x, lengths))
    wider = Lengths(torch.arange(5.0), torch.full((2, 5, 1), 2.0))
    assert torch.allclose(cap.gm(torch.ones(2, 5, 4), lengths=wider),
                          model(torch.ones(2, 5, 4), wider))


class CachedTable(nn.Module):
    """A rotary-style table built by a ``functools.lru_cache`` method keyed by a size, as
    diffusers' NucleusMoE and Qwen-Image build theirs."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs", torch.randn(32, 4))

    @functools.lru_cache(maxsize=8)
    def table(self, n: int) -> torch.Tensor:
        return self.freqs[:n].clone()


class ScaledByTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.rope, self.lin = CachedTable(), nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.rope.table(8)


def test_a_method_cache_is_traced_and_left_empty():
    """The table is traced into the graph, not read from a cache a traced call filled: a
    second capture of the model (explain, then parallelize) used to find a fake tensor among
    its constants, and the model's own next call got a fake tensor back."""
    model, x = ScaledByTable(), torch.randn(2, 8, 4)
    want = model.lin(x) * model.rope.freqs[:8]
    for _ in range(2):
        cap = capture(model, (x,))
        assert CachedTable.table.cache_info().currsize == 0
        assert torch.equal(cap.gm(x), want)
    assert torch.equal(model(x), want)  # an eager call fills the cache with a real table
    assert torch.equal(capture(model, (x,)).gm(x), want)
