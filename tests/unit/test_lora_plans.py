"""Frozen weights and LoRA adapters, planned without a process group (``tpcompile.explain``).

A frozen model is planned exactly like the trainable one; a LoRA model pays the forward
collectives of its frozen base model and holds 1/N of each base weight the base plan shards:
a column-parallel base's ``A`` whole and ``B`` cut like the base's output features, a
row-parallel base's ``A`` cut like its input features and ``B`` whole. Numerics on gloo
ranks: ``tests/gloo/test_lora.py``.
"""

from __future__ import annotations

import collections

import pytest
import torch

from tpcompile.inspect.explain.explain import explain
from zoo import lora_models

pytest.importorskip("transformers")


def _report(model, inputs, kwargs, ws):
    return explain(model, inputs, world_size=ws, example_kwargs=kwargs or None, dynamic=False)


def _collectives(report, phase: str) -> collections.Counter:
    return collections.Counter(c.op for c in report.collectives if c.phase == phase)


@pytest.mark.parametrize("ws", [2, 4])
def test_frozen_hf_llama_is_planned_like_the_trainable_one(ws):
    """Frozen and planned under ``torch.no_grad`` (as an inference script would): the same
    styles, shards, forward collectives and bytes; no gradient sync."""
    model = lora_models.hf_llama()
    inputs, kwargs = lora_models.hf_inputs(model)
    trainable = _report(model, inputs, kwargs, ws)
    with torch.no_grad():
        frozen = _report(model.requires_grad_(False), inputs, kwargs, ws)
    for name, p in trainable.params.items():
        q = frozen.params[name]
        assert (q.style, q.local_shapes, q.parameter) == (p.style, p.local_shapes, p.parameter)
        assert not q.trainable and not q.grad_sync, name
    assert _collectives(frozen, "forward") == _collectives(trainable, "forward")
    assert frozen.param_bytes_per_rank == trainable.param_bytes_per_rank
    assert sum(_collectives(trainable, "backward").values()) > 0
    assert not _collectives(frozen, "backward")  # token ids in, nothing to differentiate


@pytest.mark.parametrize("name, ws", [("llama", 2), ("llama", 4), ("peft_qv", 2), ("peft_all", 2),
                                      ("peft_all", 4)])
def test_lora_pays_the_base_models_forward_collectives(name, ws):
    model, inputs, kwargs, base = lora_models.build(name)
    lora, plain = _report(model, inputs, kwargs, ws), _report(base, inputs, kwargs, ws)
    assert _collectives(lora, "forward") == _collectives(plain, "forward")
    for path, (w, a, b) in lora_models.adapters(model).items():
        want = plain.params[lora_models.base_fqn(path)]
        got, pa, pb = lora.params[w], lora.params[a], lora.params[b]
        assert (got.style, got.local_shapes) == (want.style, want.local_shapes), w
        assert not got.trainable and pa.trainable and pb.trainable
        if want.style == "colwise":  # A whole, B cut like the base's output features
            assert pa.style == "replicate" and pb.local_shape[0] == got.local_shape[0], path
            assert got.local_shape[0] * ws == got.global_shape[0]
        elif want.style == "rowwise":  # A cut like the base's input features, B whole
            assert pa.local_shape[1] == got.local_shape[1] and pb.style == "replicate", path
            assert got.local_shape[1] * ws == got.global_shape[1]
