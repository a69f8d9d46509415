"""Sequence parallelism (Megatron-SP) on gloo ranks: numerics, collectives, activation memory."""

from __future__ import annotations

import pytest

from support import cases, launch

pytestmark = pytest.mark.dist
NAMES = ["mlp", "gpt2", "llama"]


@pytest.fixture(scope="module")
def results():
    return {ws: launch("sequence_parallel", ws, NAMES) for ws in (2, 4)}


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_matches_unsharded(results, ws, name):
    for c in cases(results, ws, name):
        cmp = c["cmp"]
        assert cmp.output_err <= 1e-5
        assert cmp.max_grad_err <= 1e-5, max(cmp.grad_errs.items(), key=lambda kv: kv[1])
        assert cmp.max_step_err <= 1e-4


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_megatron_sp_collectives(results, ws, name):
    """Per chain: one all-gather in, one reduce-scatter out; the backward is the conjugate
    (a reduce-scatter for the gather, an all-gather for the reduce-scatter) plus, as in
    Megatron-LM, a second all-gather of the chain's input for the weight gradients instead of
    keeping the gathered input in memory. No activation all-reduce is left; the only
    all-reduces are weight-gradient syncs of replicated weights that now see sequence shards
    (norms, row-parallel biases)."""
    c = cases(results, ws, name)[0]
    chains = c["n_layers"] * (1 if name == "mlp" else 2)
    fwd, bwd = c["cmp"].collectives["forward"], c["cmp"].collectives["backward"]
    assert fwd == {"all_gather": chains + 1, "reduce_scatter": chains}  # +1: the output
    assert bwd["reduce_scatter"] == chains and bwd["all_gather"] == 2 * chains


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_activation_memory_drops(results, ws, name):
    """Saved-for-backward bytes per rank: tensor parallelism shards the chains' insides,
    sequence parallelism the rest (norms, residuals, the chains' inputs)."""
    c = cases(results, ws, name)[0]
    assert c["saved_sp"] < c["saved_tp"] < c["saved_full"]
    assert c["saved_sp"] <= c["saved_full"] / ws * 1.25
