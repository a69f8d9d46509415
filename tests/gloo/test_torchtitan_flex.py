"""torchtitan 0.3's language models (flex attention only), when that release is installed.

The ``debugmodel`` flavours of its llama3 and qwen3 registries (fused ``wqkv`` viewed as (kv
heads, q per kv + 2, head_dim) and split; a document BlockMask from ``get_attention_masks``
passed as ``attention_masks``), at 2 and 4 ranks: planned at Megatron's bound derived from the
model with nothing gathered, and on gloo ranks the output equal to the unsharded model's and
every gradient to the unsharded captured graph's (torch refuses the model's own flex attention
backward on CPU; the captured higher-order op's dense backward runs). The bench extra pins
torchtitan 0.2.2 (bench/upstream.py's rows); 0.3 installs beside torch 2.13 without another
torch (``pip install --no-deps torchtitan==0.3.0 spmd_types tyro docstring_parser triton``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from support import LaunchedOnDemand
from tpcompile.tools.launch import run_on_ranks
from zoo import flex_models

try:
    TITAN = version("torchtitan")
except PackageNotFoundError:
    TITAN = ""
pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    not TITAN.startswith("0.3"), reason=f"needs torchtitan 0.3 (installed: {TITAN or 'none'})")]

BODIES = str(Path(__file__).parent / "flex_workers.py")
KINDS = ["llama3", "qwen3"]
TOLERANCE = 1e-5
_runs = LaunchedOnDemand(lambda ws: run_on_ranks(f"{BODIES}:titan_cases", ws, KINDS,
                                                 timeout=1800))


@pytest.mark.parametrize("kind,world_size", [(k, ws) for k in KINDS for ws in (2, 4)])
def test_planned_at_the_bound(kind, world_size):
    import tpcompile

    model, inputs, kwargs = flex_models.torchtitan(kind)
    report = tpcompile.explain(model, inputs, world_size, example_kwargs=kwargs)
    assert not report.fallbacks, report.fallbacks
    assert "-> at the bound" in str(report), str(report)[-3000:]


@pytest.mark.parametrize("kind,world_size", [(k, ws) for k in KINDS for ws in (2, 4)])
def test_forward_and_every_gradient_exact(kind, world_size):
    model = flex_models.torchtitan(kind)[0]
    blocks = sum(p.dim() == 2 for n, p in model.named_parameters() if n.startswith("layers."))
    for result in (r[kind] for r in _runs[world_size]):
        assert "error" not in result, result["error"]
        assert result["output_err"] <= TOLERANCE, result
        assert len(result["grad_errs"]) == sum(p.requires_grad for p in model.parameters())
        assert max(result["grad_errs"].values()) <= TOLERANCE, result
        assert result["sharded"] == blocks, result  # every block matrix cut
