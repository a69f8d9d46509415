"""Plans of decoders that own a static KV cache (zoo/cache_models.py), without processes.

The cache buffers are stored sharded on their kv-head dim (each rank: kv_heads / N heads, or
with fewer kv heads than ranks the one kv head its query heads read), the writes into them
need no conversion, and the only collectives are Megatron's: one all-reduce per attention
block and one per MLP block, for the prefill capture and for the one-token decode capture.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from support import rewrite_ranks
from tpcompile.runtime.collectives import count_collectives
from zoo.cache_models import CachedDecoder

LAYERS, HEADS = 2, 4


@pytest.mark.parametrize("ws,kv_heads,seq_major", [(2, 2, False), (2, 2, True), (4, 4, False),
                                                   (4, 2, True), (4, 1, False)])
@pytest.mark.parametrize("length", [5, 1])  # the prefill and the decode signature
def test_cache_sharded_on_kv_heads_with_megatron_collectives(ws, kv_heads, seq_major, length):
    model = CachedDecoder(kv_heads=kv_heads, heads=HEADS, layers=LAYERS, seq_major=seq_major)
    with warnings.catch_warnings():  # "accepts only 1 there": the decode signature's point
        warnings.simplefilter("ignore")
        plan, _, graphs = rewrite_ranks(model, (torch.zeros(2, length, dtype=torch.long),
                                                torch.arange(length)), ws)
    head_dim = 2 if seq_major else 1
    caches = [e for e in plan.params.values() if "kv_cache" in e.name]
    assert len(caches) == 2 * LAYERS
    # each rank holds kv_heads / N heads, or the single kv head its query heads read
    per_rank = max(kv_heads // ws, 1)
    for entry in caches:
        for shape in entry.local_shapes:
            assert shape[head_dim] == per_rank, (entry.name, shape)
    writes = [c for c in plan.conversions if c.user.startswith("index_put")]
    # local writes: no conversion of the cache; k and v need at most a local slice of their
    # replicated values (fewer kv heads than ranks), never a collective
    assert all(c.kind == "slice" and not c.value.startswith("slice") for c in writes), writes
    assert bool(writes) == (kv_heads < ws)
    for gm in graphs:
        assert count_collectives(gm)["forward"] == {"all_reduce": 2 * LAYERS}
