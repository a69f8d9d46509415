"""The README's plan-quality numbers, each against an ideal computed from the model itself.

"The ideal" never comes from the plan under test: Megatron's layout shards every
``nn.Linear`` inside the repeated blocks by 1/N (k and v projections whole when there are
fewer KV heads than ranks: Megatron-LM replicates them too) and keeps the rest (embeddings,
norms, the output head) whole. Uneven splits are computed the same way: whole heads, the
first ranks taking one more (``torch.tensor_split``). The bound on collectives is Megatron's
per-layer count, one all-reduce each way per column -> row chain (attention and MLP).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.tools import models

SHAPES = {  # the widths of Llama 7B and 70B (GQA 8), 2 layers: per-rank ratios do not depend on depth
    "7B": dict(dim=4096, n_heads=32, n_kv_heads=8, hidden=11008),
    "70B": dict(dim=8192, n_heads=64, n_kv_heads=8, hidden=28672),
}


def _largest_rank_ideal(model: nn.Module, world_size: int) -> int:
    """Bytes the largest rank of the built-in Llama holds under Megatron's layout: each block
    linear cut in whole units (heads, kv heads, hidden features), the rest whole."""
    cfg = model.cfg
    units = {"wq": cfg.n_heads, "wo": cfg.n_heads, "wk": cfg.n_kv_heads, "wv": cfg.n_kv_heads,
             "w1": cfg.hidden, "w3": cfg.hidden, "w2": cfg.hidden}
    total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        n = units.get(name.split(".")[-2]) if name.startswith("layers.") else None
        if n is None or n < world_size:  # not a block linear, or too few heads (Megatron-LM too)
            total += size
        else:
            total += size // n * math.ceil(n / world_size)
    return total


@pytest.mark.parametrize("shape", SHAPES)
def test_llama_shapes_at_8_ranks_hold_exactly_the_ideal(shape):
    """README: the largest rank holds exactly the ideal, Llama 7B and 70B shapes at 8 ranks."""
    with torch.device("meta"):
        model = models.build("llama", vocab=32000, n_layers=2, max_seq=2048, **SHAPES[shape])
    tokens = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    report = tpcompile.explain(model, (tokens,), 8)
    assert max(report.param_bytes_per_rank) == _largest_rank_ideal(model, 8)


def test_uneven_heads_cost_what_whole_heads_cost():
    """README: +10.6% over sharded / N + replicated with 6 heads on 4 ranks; that is the price
    of whole heads (the largest rank holds 2 of 6), not of the plan."""
    model = models.build("llama", dim=96, n_heads=6, n_kv_heads=6, hidden=100, n_layers=2)
    report = tpcompile.explain(model, models.example_inputs(model, 2, 16), 4)
    largest = max(report.param_bytes_per_rank)
    assert largest == _largest_rank_ideal(model, 4)
    blocks = [m for n, m in model.named_modules() if n.startswith("layers.")
              and isinstance(m, nn.Linear)]
    sharded = sum(p.numel() * p.element_size() for m in blocks for p in m.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters()) - sharded
    assert f"{largest / (sharded / 4 + whole) - 1:.1%}" == "10.6%"


@pytest.mark.parametrize("name", ["mlp", "gpt2", "llama"])
def test_built_in_models_at_8_ranks_pay_megatrons_count(name):
    """README: zero excess collectives at 2, 4 and 8 ranks (2 and 4: the support table's test)."""
    model = models.build(name)
    report = tpcompile.explain(model, models.example_inputs(model), 8)
    chains = {"mlp": 1}.get(name, 2)
    layers = [m for m in report.megatron if m.layer]
    assert layers and all((m.forward, m.backward) == (chains, chains) for m in layers), layers
    assert not any(m.above() for m in layers), layers  # Megatron's bound, derived from the model
    assert all(m.forward == m.backward == 0 for m in report.megatron if not m.layer)
