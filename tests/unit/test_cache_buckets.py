"""Cache lengths ``generate`` captures: few buckets, none shorter than needed, within limits;
the static-cache wrapper hands its cache to the model under the name the model's forward takes."""

from __future__ import annotations

import pytest
import torch

from tpcompile.runtime.cache_modules import cache_length
from tpcompile.runtime.static_cache import StaticCacheLM


@pytest.mark.parametrize("needed, bucket", [
    (1, 64), (64, 64), (65, 128), (513, 1024), (1024, 1024), (1025, 2048), (3000, 3072),
])
def test_powers_of_two_up_to_1024_then_multiples_of_1024(needed, bucket):
    assert cache_length(needed) == bucket


def test_a_limit_the_tokens_fit_caps_the_bucket():
    assert cache_length(10, limit=40) == 40  # a 40-position model: no 64-position cache
    assert cache_length(10, limit=4096) == 64
    assert cache_length(50, limit=40) == 64  # past the limit: the model's own error, not ours


def _installed_keyword() -> str:
    import inspect

    import transformers
    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@pytest.mark.parametrize("name", ["llama", "llama_pkv"])
def test_the_wrapper_passes_its_cache_under_the_forwards_own_name(name):
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``. A name the
    forward does not take would vanish into its ``**kwargs``: the buffers never written."""
    pytest.importorskip("transformers")
    from zoo.hf_models import hf_causal_lm

    if name == "llama_pkv" and _installed_keyword() != "cache":
        pytest.skip("this transformers spells it past_key_values itself: 'llama' is that case")
    keyword = "past_key_values" if name == "llama_pkv" else _installed_keyword()
    wrapper = StaticCacheLM(hf_causal_lm(name).eval(), batch=1, max_len=8)
    assert wrapper.cache_kwarg == keyword
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        wrapper(ids, torch.ones(1, 8, dtype=torch.long), torch.arange(3)[None], torch.arange(3))
    assert wrapper.key_cache_0[:, :, :3].abs().sum() > 0  # the prefill's keys were stored
    assert wrapper.key_cache_0[:, :, 3:].abs().sum() == 0
