"""Later call signatures captured on the meta copy of a model, without processes: the plain
tensor attributes a graph reads (litgpt's mask cache, rotary tables) get their real values."""

from __future__ import annotations

import pytest
import torch

from tpcompile.api import SignatureCapture, plan_model
from tpcompile.errors import TPCompileError
from tpcompile.runtime.signatures import plain_tensors
from zoo.lit_cache_models import LitCachedDecoder

PROMPT = 5


def _decoder(device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = LitCachedDecoder()
        model.set_kv_cache(2)
    return model


def _decode_graph(model):
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    _, plan = plan_model(model, (prompt, torch.arange(PROMPT)), 2)
    capture = SignatureCapture(model, plan, 0, "tp")
    return capture, capture((prompt[:, :1], torch.tensor([PROMPT])), {})[0]


def test_plain_tensors_are_named_by_fqn_without_parameters_or_buffers():
    model = _decoder()
    assert sorted(plain_tensors(model)) == ["cos", "mask_cache", "sin"]


def test_a_decode_capture_reads_the_real_plain_attributes():
    model = _decoder()
    capture, gm = _decode_graph(model)
    assert all(t.is_meta for t in plain_tensors(capture.skeleton).values())
    for name, want in plain_tensors(model).items():
        got = getattr(gm, name)
        assert not got.is_meta and torch.equal(got, want) and got is not want


def test_a_meta_plain_attribute_is_named():
    with pytest.raises(TPCompileError, match="reads the tensor constant (cos|sin|mask_cache), "
                                             "created on the meta device"):
        _decode_graph(_decoder("meta"))
