"""The static-cache modules ``generate`` captures: one per batch size and cache bucket, few kept.

Capturing and planning the :class:`~tpcompile.runtime.static_cache.StaticCacheLM` wrapper is
what a first ``generate`` pays for (tens of seconds on a 1B-parameter model), so captures are
shared as widely as exactness allows:

- **Prompt lengths share a graph.** The prefill is captured with a symbolic sequence length
  (capture exports every input dim as ``Dim.AUTO``), so every prompt of 2 or more tokens runs
  the same prefill graph; a 1-token prompt runs the decode step's graph. Prompts are not
  padded.
- **Cache lengths come in buckets** (:func:`cache_length`): prompt + new tokens rounded up to
  a power of two from 64 to 1024, then to a multiple of 1024, and never past the model's
  position limit or sliding window when the tokens fit it. The slots past the generated
  tokens stay masked (attention mask 0 and the causal mask by ``cache_position``), so the
  logits are those of a cache of the exact length.

Memory: the store (``tp.generation_modules``, least recently used first) keeps at most
:data:`MAX_MODULES` modules, each with at most ``MAX_SIGNATURES`` graphs (a prefill and a
decode step in practice) whose weights are the module's own shards. Only the module in use
holds a KV cache: the others' cache buffers are replaced by meta tensors of their shape and
allocated again (zeros, as ``generate`` resets them anyway) when a call reuses the module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpcompile.runtime.signatures import bind_tensors
from tpcompile.runtime.static_cache import StaticCacheLM

__all__ = ["MAX_MODULES", "cache_length", "cached_module"]

MAX_MODULES = 4  # (batch, cache bucket) captures kept; only the one in use holds its cache
MIN_CACHE, BLOCK = 64, 1024


def cache_length(needed: int, limit: int | None = None) -> int:
    """The cache bucket for ``needed`` positions: a power of two from :data:`MIN_CACHE` up to
    :data:`BLOCK`, then a multiple of ``BLOCK``; ``limit`` instead when the bucket would pass
    it and ``needed`` fits (the model's position table or sliding window)."""
    size = MIN_CACHE
    while size < needed and size < BLOCK:
        size *= 2
    if size < needed:
        size = -(-needed // BLOCK) * BLOCK
    if limit is not None and needed <= limit < size:
        size = limit
    return size


def cached_module(tp, batch: int, max_len: int):
    """The module (of ``type(tp)``) running the static-cache wrapper for ``batch`` rows and a
    cache of ``max_len`` positions, captured on first use; its KV cache allocated."""
    store = tp.generation_modules
    key = (batch, max_len)
    if store and next(reversed(store)) == key:
        return store[key]  # the module in use: its cache held, every other one released
    if key in store:
        store.move_to_end(key)
    else:
        store[key] = _capture(tp, batch, max_len)
        while len(store) > MAX_MODULES:
            store.popitem(last=False)
    for other_key, other in store.items():
        if other_key != key:
            _release_cache(other)
    inner = store[key]
    _allocate_cache(inner, next(tp.parameters(), torch.empty(0)).device)
    return inner


def _capture(tp, batch: int, max_len: int):
    """Capture, plan and bind the wrapper: a new module sharing ``tp``'s parameter shards."""
    capture = tp.skeleton_capture
    config = capture.skeleton.config.get_text_config()
    kv_heads = getattr(config, "num_key_value_heads", None)
    # fewer kv heads than ranks: attend through SDPA's enable_gqa (see static_cache.sdpa_gqa)
    gqa = (kv_heads is not None and kv_heads < dist.get_world_size(tp.group)
           and getattr(config, "_attn_implementation", None) == "sdpa")
    wrapper = StaticCacheLM(capture.skeleton, batch, max_len, gqa_in_sdpa=gqa)
    # a prompt length no other input dim has (export would tie equal example sizes): 3 or 5
    n = 3 if batch != 3 else 5
    meta = dict(device="meta", dtype=torch.long)
    example = (torch.empty(batch, n, **meta), torch.empty(batch, max_len, **meta),
               torch.empty(batch, n, **meta), torch.empty(n, **meta))
    device = next(tp.parameters(), torch.empty(0)).device  # the example is meta, shards not
    gm, plan = capture(example, {}, module=wrapper, prefix="model.", device=device)
    bind_tensors(gm, tp, plan, prefix="model.", rank=tp.rank)
    return type(tp)(gm, plan, tp.rank, tp.group, tp.call_check.mode,
                    capture_signature=lambda args, kwargs: capture(args, kwargs, module=wrapper,
                                                                   prefix="model."))


def _release_cache(inner) -> None:
    """Free the KV cache of a module not in use: its buffers become meta tensors (shapes kept)."""
    _replace_cache(inner, lambda b: b if b.is_meta else torch.empty_like(b, device="meta"))


def _allocate_cache(inner, device: torch.device) -> None:
    """Give a released module its KV cache back: zeros on ``device``."""
    _replace_cache(inner, lambda b: torch.zeros_like(b, device=device) if b.is_meta else b)


def _replace_cache(inner, make) -> None:
    """Apply ``make`` to each buffer the graphs write (the cache) and re-bind every graph."""
    replaced = False
    for buffers, leaf in inner.cache_slots():
        new = make(buffers[leaf])
        replaced |= new is not buffers[leaf]
        buffers[leaf] = new
    if replaced:
        for _, gm in inner.signatures:
            bind_tensors(gm, inner)
        inner.__dict__.pop("compiled_decode", None)  # compiled against the old tensors
