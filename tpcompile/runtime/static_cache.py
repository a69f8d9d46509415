"""The static-cache wrapper ``generate`` captures: a causal LM whose KV cache is its buffers.

:class:`StaticCacheLM` (after ``transformers.integrations.executorch``) owns a ``transformers``
``StaticCache`` as buffers: the cache is written in place at each step's positions, so the
planner shards it on its kv-head dim like the k and v activations it stores, and the write
stays local. Its parameters are the parallelized module's own tensors (bound by name after the
capture); only the cache is allocated anew.
"""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["StaticCacheLM", "sdpa_gqa"]


class StaticCacheLM(nn.Module):
    """``forward(input_ids, attention_mask (B, max_len), position_ids, cache_position) -> logits``
    of a causal LM whose ``StaticCache`` tensors are this module's buffers.

    The logits are the last position's, ``(B, 1, vocab)``, when the model takes
    ``logits_to_keep`` (as ``GenerationMixin.generate`` asks of it): the next token reads only
    those, and a prefill's LM head over every prompt position would cost, on a
    Llama-3.2-1B-shaped model, a third of its work. Otherwise every position's."""

    # layer i's cache is kept here, not in block i: tpcompile.core.stamp repeats it with the
    # block when it exports three blocks and stamps the rest
    per_block_attributes = ("key_cache_{}", "value_cache_{}")
    # the cache writes: export records model lines at once (tpcompile.core.capture.IN_PLACE)
    writes_buffers_in_place = True

    def __init__(self, model: nn.Module, batch: int, max_len: int, gqa_in_sdpa: bool = False):
        super().__init__()
        self.gqa_in_sdpa = gqa_in_sdpa
        supports = getattr(model, "_supports_logits_to_keep", None)
        self.last_logits = {"logits_to_keep": 1} if callable(supports) and supports() else {}
        from transformers.cache_utils import StaticCache, StaticLayer
        from transformers.integrations.executorch import get_head_shapes

        self.model = model
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``; a name the
        # forward does not take would be swallowed by its **kwargs and the cache left unused
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        config = model.config.get_text_config()
        self.cache = StaticCache(max_cache_len=max_len, config=config)
        # a sliding layer's roll-over is data-dependent control flow export cannot capture; up
        # to the window (generate checks the length) a full static layer computes the same
        step = _step_layer()
        self.cache.layers = [step(max_len) if isinstance(layer, StaticLayer) else layer
                             for layer in self.cache.layers]
        heads, head_dim = get_head_shapes(config)
        weight = next(model.parameters())
        self.cache.early_initialization(batch, heads, head_dim, weight.dtype, weight.device)
        for i, layer in enumerate(self.cache.layers):
            for name, t in zip(self._cache_names(i), (layer.keys, layer.values)):
                self.register_buffer(name, t, persistent=False)
        self.register_buffer("cumulative_length", self.cache.layers[0].cumulative_length,
                             persistent=False)

    def _cache_names(self, i: int) -> list[str]:
        """Layer ``i``'s key and value cache buffers."""
        return [pattern.format(i) for pattern in self.per_block_attributes]

    def forward(self, input_ids, attention_mask, position_ids, cache_position):
        self.cumulative_length.copy_(cache_position[0])  # where this call's tokens go
        for i, layer in enumerate(self.cache.layers):
            # the buffers themselves, not the tensors the cache object captured at init:
            # export traces module buffers, and the rank's shards replace them
            layer.keys, layer.values = (getattr(self, name) for name in self._cache_names(i))
            layer.cumulative_length = self.cumulative_length
        with sdpa_gqa(self.gqa_in_sdpa):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=True,
                              **{self.cache_kwarg: self.cache}, **self.last_logits).logits


@functools.cache
def _step_layer():
    """transformers' ``StaticLayer`` writing each call's tokens at the positions from
    ``cumulative_length`` (the wrapper's one buffer, set from the call's ``cache_position``)
    without advancing it. The stock layer adds the tokens written to a tensor of its own, so
    each block read a value of its own from outside the block and a deep model's blocks could
    not be exported three and repeated (``tpcompile.core.stamp``); here every block reads the
    same one, and its own cache (``per_block_attributes``)."""
    from transformers.cache_utils import StaticLayer

    class StepLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
            self.keys.index_copy_(2, positions, key_states)
            self.values.index_copy_(2, positions, value_states)
            return self.keys, self.values

    return StepLayer


@contextmanager
def sdpa_gqa(on: bool):
    """While tracing, let transformers' SDPA attention read grouped kv heads itself.

    Under export, transformers repeats the kv heads (``repeat_kv``: expand + reshape) unless
    ``TRANSFORMERS_SDPA_FORCE_GQA`` asks for SDPA's ``enable_gqa``. With fewer kv heads than
    ranks the planner can only cut the repeated heads, so k, v and the cache they are stored
    in stay whole; through ``enable_gqa`` each rank stores just the kv heads its query heads
    read (``Layout.cover``). Same math; only the traced spelling changes.
    """
    if not on:
        yield
        return
    before = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRANSFORMERS_SDPA_FORCE_GQA"]
        else:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = before
