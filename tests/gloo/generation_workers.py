"""Rank-side bodies of tests/gloo/test_generation.py: decoders that own a static KV cache.

Each case parallelizes :class:`cache_models.CachedDecoder`, runs a prefill and greedy decode
steps on the ranks and on the unsharded model, and reports the tokens, the cache each rank
holds, the collectives each call signature's graph issues, and how bad calls are refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tpcompile  # noqa: E402
from cache_models import CachedDecoder, greedy  # noqa: E402
from tpcompile.runtime.collectives import count_collectives  # noqa: E402

PROMPT, NEW = 5, 6


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _case(rank: int, world_size: int, kv_heads: int, seq_major: bool) -> dict:
    torch.manual_seed(0)
    model = CachedDecoder(kv_heads=kv_heads, seq_major=seq_major)
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tp = tpcompile.parallelize(model, (prompt, torch.arange(PROMPT)))
    want = greedy(model, prompt, NEW)
    got = greedy(tp, prompt, NEW)
    caches = {n: tuple(b.shape) for n, b in tp.named_buffers() if "cache" in n}
    written = sum(float(b.abs().sum()) for n, b in tp.named_buffers() if "cache" in n)
    tp.reset_caches()
    after_reset = sum(float(b.abs().sum()) for n, b in tp.named_buffers() if "cache" in n)
    again = greedy(tp, prompt, NEW)  # after a reset: the same tokens again
    graphs = [tp.graph_module] + [gm for _, gm in tp.signatures]
    return {
        "tokens": got.tolist(), "want": want.tolist(), "again": again.tolist(),
        "caches": caches, "full_cache": tuple(model.blocks[0].attn.kv_cache.k_cache.shape),
        "written": written, "after_reset": after_reset,
        "collectives": [count_collectives(gm)["forward"] for gm in graphs],
        "shared": all(gm.get_parameter("blocks.0.w1.weight") is tp.get_parameter("blocks.0.w1.weight")
                      and gm.get_buffer("blocks.0.attn.kv_cache.k_cache")
                      is tp.get_buffer("blocks.0.attn.kv_cache.k_cache") for gm in graphs),
        "beyond_cache": _error(lambda: tp(prompt[:, :1], torch.tensor([40]))),
        "batch_too_large": _error(lambda: tp(torch.zeros(3, 1, dtype=torch.long),
                                             torch.tensor([7]))),
        "after_errors": tp(prompt[:, :1], torch.tensor([PROMPT])).shape[-1],  # no hang, no desync
    }


def static_cache(rank: int, world_size: int, cases: list) -> dict:
    return {tuple(c): _case(rank, world_size, *c) for c in cases}
