"""KV caches off for capture: every config a model's modules read ``use_cache`` from.

An encoder-decoder's stacks keep their own copies of the config, and multimodal configs nest
theirs; capture switches each off and restores each. A cache returned anyway is refused with
a hint that names ``use_cache``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcompile.core.cache_configs import caches_off, reachable_configs
from tpcompile.core.capture import capture
from tpcompile.errors import CaptureError

transformers = pytest.importorskip("transformers")


def _t5():
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                   num_heads=4)
    return transformers.T5ForConditionalGeneration(config)


class _Composite(nn.Module):
    """A module whose config nests the one its language model reads (``text_config``)."""

    def __init__(self):
        super().__init__()
        self.config = transformers.Qwen2VLConfig()


def test_every_stack_config_is_switched_off_and_restored():
    model = _t5()
    assert model.decoder.config is not model.config  # the stack's own copy
    configs = reachable_configs(model)
    assert len(configs) == 3 and model.decoder.config in configs
    before = [c.use_cache for c in configs]  # T5's encoder stack: False already
    assert model.config.use_cache and model.decoder.config.use_cache
    notes: list[str] = []
    with caches_off(model, notes):
        assert not any(c.use_cache for c in configs)
    assert len(notes) == 1
    assert [c.use_cache for c in configs] == before  # the user's configs as they were


def test_nested_sub_configs_are_switched_off_and_restored():
    model = _Composite()
    text = model.config.text_config
    assert text.use_cache
    with caches_off(model, []):
        assert text.use_cache is False
    assert text.use_cache is True


def test_restored_when_capture_fails():
    model = _t5()
    with pytest.raises(RuntimeError), caches_off(model, []):
        raise RuntimeError("export failed")
    assert model.decoder.config.use_cache is True


class _ReturnsCache(nn.Module):
    """Returns a KV cache whatever its config says (a module that ignores ``use_cache``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x), transformers.DynamicCache()


def test_a_cache_in_the_output_is_refused_with_the_use_cache_fix():
    with pytest.raises(CaptureError, match="DynamicCache") as err:
        capture(_ReturnsCache(), (torch.randn(2, 8),))
    assert "hint: the model returns a KV cache" in str(err.value)
    assert "use_cache=False" in str(err.value)
