"""``TPModule.generate``: Hugging Face ``model.generate`` on this rank's shards.

The module ``parallelize`` returned runs the graph captured for its example call (no KV cache:
Hugging Face models are captured with ``use_cache=False``). Generation captures, once per
(batch, cache length), a wrapper that owns a ``transformers`` ``StaticCache`` as buffers
(:class:`StaticCacheLM`, after ``transformers.integrations.executorch``): the cache is written
in place at each step's positions, so the planner shards it on its kv-head dim like the k and
v activations it stores, and the write stays local. Its parameters are the module's own
tensors (the shards training updates), bound by name; only the cache is allocated anew.

The loop is ``GenerationMixin.generate``'s, reusing its pieces on the model's meta skeleton:
the generation config (``_prepare_generation_config``), the logits processors and warpers
(``_get_logits_processor``), position ids from the attention mask (left padding), EOS and pad
handling. Every rank computes the same replicated logits; the next tokens are chosen on the
group's first rank and broadcast, so ranks never diverge (sampling consumes that rank's RNG:
seed it as you would seed the unsharded model).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from tpcompile.errors import InputError, TPCompileError

__all__ = ["StaticCacheLM", "generate"]


class StaticCacheLM(nn.Module):
    """``forward(input_ids, attention_mask (B, max_len), position_ids, cache_position) -> logits``
    of a causal LM whose ``StaticCache`` tensors are this module's buffers."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, gqa_in_sdpa: bool = False):
        super().__init__()
        self.gqa_in_sdpa = gqa_in_sdpa
        from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer
        from transformers.integrations.executorch import get_head_shapes

        self.model = model
        config = model.config.get_text_config()
        self.cache = StaticCache(max_cache_len=max_len, config=config)
        for i, layer in enumerate(self.cache.layers):
            # its roll-over is data-dependent control flow export cannot capture; up to the
            # window (generate checks the length) a full static layer computes the same
            if isinstance(layer, StaticSlidingWindowLayer):
                self.cache.layers[i] = StaticLayer(max_len)
        heads, head_dim = get_head_shapes(config)
        weight = next(model.parameters())
        self.cache.early_initialization(batch, heads, head_dim, weight.dtype, weight.device)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
            self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids, attention_mask, position_ids, cache_position):
        for i, layer in enumerate(self.cache.layers):
            # the buffers themselves, not the tensors the cache object captured at init:
            # export traces module buffers, and the rank's shards replace them
            layer.keys, layer.values = getattr(self, f"key_cache_{i}"), getattr(self, f"value_cache_{i}")
            layer.cumulative_length = getattr(self, f"cumulative_length_{i}")
            layer.cumulative_length.copy_(cache_position[0])
        with _sdpa_gqa(self.gqa_in_sdpa):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, cache=self.cache, use_cache=True).logits


@contextmanager
def _sdpa_gqa(on: bool):
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


def _cached_module(tp, batch: int, max_len: int, prompt_len: int):
    """The module (of ``type(tp)``) running the static-cache wrapper for this batch and length."""
    from tpcompile.runtime.signatures import bind_tensors

    store = tp.__dict__.setdefault("_generation", {})
    key = (batch, max_len)
    if key not in store:
        capture = tp.skeleton_capture
        config = capture.skeleton.config.get_text_config()
        kv_heads = getattr(config, "num_key_value_heads", None)
        # fewer kv heads than ranks: attend through SDPA's enable_gqa (see _sdpa_gqa)
        gqa = (kv_heads is not None and kv_heads < dist.get_world_size(tp.group)
               and getattr(config, "_attn_implementation", None) == "sdpa")
        wrapper = StaticCacheLM(capture.skeleton, batch, max_len, gqa_in_sdpa=gqa)
        n = max(prompt_len, 2)
        meta = dict(device="meta", dtype=torch.long)
        example = (torch.empty(batch, n, **meta), torch.empty(batch, max_len, **meta),
                   torch.empty(batch, n, **meta), torch.empty(n, **meta))
        device = next(tp.parameters(), torch.empty(0)).device  # the example is meta, shards not
        gm, plan = capture(example, {}, module=wrapper, prefix="model.", device=device)
        bind_tensors(gm, tp, plan, prefix="model.", rank=tp.rank)
        inner = type(tp)(gm, plan, tp.rank, tp.group, tp.call_check.mode)
        inner.capture_signature = lambda args, kwargs: capture(args, kwargs, module=wrapper,
                                                               prefix="model.")
        store.clear()  # one cache at a time: a new batch or length frees the last one
        store[key] = inner
    return store[key]


def _decode_step(tp, module):
    """What a decode step calls: ``module``, or ``torch.compile`` of it (``tp.compile_generation``)
    once its one-token signature is captured."""
    if tp.generation_compile is None or not module.signatures:
        return module
    if "compiled_decode" not in module.__dict__:  # not a child module: no state_dict entries
        module.__dict__["compiled_decode"] = torch.compile(module, **tp.generation_compile)
    return module.__dict__["compiled_decode"]


@torch.no_grad()
def generate(tp, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             generation_config=None, **kwargs) -> torch.Tensor:
    """See :meth:`tpcompile.TPModule.generate`."""
    skeleton = getattr(tp.skeleton_capture, "skeleton", None)
    if skeleton is None or not callable(getattr(skeleton, "_get_logits_processor", None)):
        raise TPCompileError("generate() needs a Hugging Face causal LM (a GenerationMixin) "
                             "parallelized with tpcompile.parallelize")
    from transformers.generation.logits_process import LogitsProcessorList

    config, unused = skeleton._prepare_generation_config(generation_config, **kwargs)
    if unused:
        raise InputError(f"generate() got arguments it does not use: {sorted(unused)}\n  hint: "
                         "pass input_ids, attention_mask and generation-config fields")
    if config.num_beams != 1 or config.num_return_sequences != 1:
        raise InputError("tpcompile's generate() decodes greedily or by sampling, one sequence "
                         f"per prompt; got num_beams={config.num_beams}, "
                         f"num_return_sequences={config.num_return_sequences}")
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be (batch, length), got {list(input_ids.shape)}")
    batch, length = input_ids.shape
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - length
    if new < 1:
        raise InputError(f"nothing to generate: max_new_tokens={new}")
    window = getattr(skeleton.config.get_text_config(), "sliding_window", None)
    if window and length + new > window:
        raise InputError(f"{length} prompt + {new} new tokens exceed the sliding window of "
                         f"{window}: tpcompile's static cache serves sliding-window layers only "
                         "up to the window")
    processors = skeleton._get_logits_processor(
        generation_config=config, input_ids_seq_length=length, encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(), device=input_ids.device)
    eos = config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=input_ids.device)
    pad = config.pad_token_id if config.pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    module = _cached_module(tp, batch, length + new, length)
    module.reset_caches()
    full = torch.zeros(batch, length + new, dtype=torch.long, device=input_ids.device)
    full[:, :length] = mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = module(input_ids, full, positions, torch.arange(length, device=input_ids.device))
    sequences, unfinished = input_ids, torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    source = dist.get_global_rank(tp.group, 0)
    for step in range(new):
        scores = processors(sequences, logits[:, -1].to(torch.float32))
        if config.do_sample:
            chosen = torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)
        else:
            chosen = scores.argmax(-1)
        dist.broadcast(chosen, src=source, group=tp.group)  # every rank feeds the same token
        if len(eos):
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
            unfinished &= ~torch.isin(chosen, eos)
        sequences = torch.cat([sequences, chosen[:, None]], dim=1)
        if step == new - 1 or not bool(unfinished.any()):
            break
        full[:, length + step] = 1
        positions = positions[:, -1:] + 1
        logits = _decode_step(tp, module)(chosen[:, None], full, positions,
                                          torch.tensor([length + step], device=input_ids.device))
    return sequences
