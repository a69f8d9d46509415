"""Randomness in sharded chains: dropout that keeps replicas consistent.

Replicated code must draw the same random numbers on every rank (their activations are
replicas), so every rank must consume the default generator identically. Sharded chains hold
different data per rank, and their local shapes can differ (uneven shards). Two rewrites keep
both true:

* ``aten.dropout`` on a sharded tensor draws the mask of the *whole* tensor from the default
  generator and keeps this rank's slice: every rank consumes the same numbers, and the result
  is exactly the unsharded model's (same seed, same mask). At ``p == 1`` it draws nothing and
  multiplies by zero, as ``aten.dropout`` does (the mask would be divided by ``1 - p = 0``).
* SDPA's internal attention dropout cannot be given a mask, so a sharded SDPA runs on a
  per-rank generator (seeded from the default seed and the rank, advanced call after call, like
  Megatron's model-parallel RNG tracker) and leaves the default generator untouched.
"""

from __future__ import annotations

import torch

__all__ = ["sharded_dropout", "per_rank_sdpa"]

_generators: dict[tuple[torch.device, int], torch.Generator] = {}


def sharded_dropout(x: torch.Tensor, p: float, train: bool, dim: int, size: int,
                    ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Dropout of this rank's slice ``ranges`` (of a dim of global ``size``) of a tensor."""
    if not train or p == 0:
        return x
    if p == 1:  # aten.dropout's own p == 1 path: no draw (the generator stays in step), x * 0
        return x * x.new_zeros(())
    shape = list(x.shape)
    shape[dim] = size
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    parts = [keep.narrow(dim, s, e - s) for s, e in ranges]
    return x * (parts[0] if len(parts) == 1 else torch.cat(parts, dim))


def _rank_generator(device: torch.device, rank: int) -> torch.Generator:
    key = (device, rank)
    if key not in _generators:
        g = torch.Generator(device=device)
        g.manual_seed((torch.initial_seed() + 7919 * (rank + 1)) % 2**63)
        _generators[key] = g
    return _generators[key]


def per_rank_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, rank: int = 0):
    """SDPA whose attention dropout draws from this rank's own generator."""
    if dropout_p == 0:
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    devices = [q.device] if q.device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=q.device.type):
        gen = _rank_generator(q.device, rank)
        if q.device.type == "cpu":
            torch.set_rng_state(gen.get_state())
        else:
            torch.cuda.set_rng_state(gen.get_state(), q.device)
        out = torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        gen.set_state(torch.get_rng_state() if q.device.type == "cpu"
                      else torch.cuda.get_rng_state(q.device))
    return out
