"""PyTorch's own transformer layers, bench/upstream.py's CI subset (the whole corpus: ``python
-m bench.upstream --numerics``): ``nn.TransformerEncoder`` and ``nn.Transformer`` (its
decoder's cross-attention included) planned at Megatron's bound at 2 and 4 ranks, and on real
gloo ranks the output and every gradient of both equal the unsharded model's.

``nn.MultiheadAttention`` packs q, k and v in one ``in_proj_weight`` and takes them apart by
``unflatten(-1, (3, E))`` and ``select``, then views (T, B, E) as (T, B * heads, head_dim): each
rank keeps its heads of all three. Cross-attention splits the weight into q rows and k / v rows
before two linears: each piece is cut by heads as its part of the weight's one root. The
encoder is post-LN: a layer's input-gradient all-reduce is counted in the layer before it (the
bound is judged by suffix sums, ``bench.hf_verdict``)."""

from __future__ import annotations

import pytest

from bench import upstream
from support import LaunchedOnDemand

pytestmark = pytest.mark.dist

# case -> the world sizes CI runs it at on gloo (heads 4: both divide them)
CASES = {
    "torch.TransformerEncoder": (2, 4),         # batch first, post-LN, self-attention
    # encoder + decoder, sequence first: the decoder's cross-attention splits in_proj_weight
    # into q and kv rows before its two linears, each piece cut by heads
    "torch.Transformer (seq first)": (2,),
}
AT_BOUND = {  # case -> the world sizes planned at the bound
    "torch.TransformerEncoder": (2, 4),
    # the decoder's self- and cross-attention q inputs and the memory's k / v input wait on
    # none of each other's matmuls: one bucketed backward all-reduce, in plan and bound
    "torch.Transformer (seq first)": (2, 4),
}

_runs = LaunchedOnDemand(lambda ws: upstream.run_numerics(
    [name for name, sizes in CASES.items() if ws in sizes], ws))


@pytest.mark.parametrize("name,world_size", [(n, ws) for n, sizes in AT_BOUND.items()
                                              for ws in sizes])
def test_planned_at_the_bound(name, world_size):
    plan = upstream.plan_at(name, world_size)
    assert plan["status"] == "at bound", {k: plan.get(k) for k in (
        "status", "why", "per_layer", "megatron_bound", "over_ideal", "gathers", "fallbacks",
        "not_sharded")}


@pytest.mark.parametrize("name,world_size",
                         [(n, ws) for n, sizes in CASES.items() for ws in sizes])
def test_outputs_and_every_gradient_exact(name, world_size):
    result = _runs[world_size][name]
    assert "error" not in result, result
    model = upstream.build(name)[0]
    assert result["grads"] == sum(p.requires_grad for p in model.parameters())
    assert result["output_err"] <= upstream.TOLERANCE, result
    assert result["max_grad_err"] <= upstream.TOLERANCE, result
