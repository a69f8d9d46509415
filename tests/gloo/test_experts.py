"""``experts="expert"``: stacked expert weights cut by whole experts, planned and run exactly.

For MoE blocks whose experts are stacked ``(experts, out, in)`` parameters applied through
``bmm`` (zoo's ``StackedMoE``; ``ScaledTokensMoE``, Llama 4's, with a shared expert beside)
or ``einsum`` over tokens broadcast to the experts (``EinsumMoE``):
every stacked weight is cut on its expert dim (uneven counts included: the first ranks take
one more), each rank holds no more than its ``ceil(E / N)`` whole experts, each MoE block
costs one forward all-reduce, ``explain`` names the placement of each block, and on gloo
ranks the output and every gradient equal the unsharded model's at two batch / length pairs.
``experts="auto"`` picks by the largest rank's share of the expert weights; fewer experts than
ranks, unknown modes and sequence parallelism get their stated answers. Looped experts
(one module per expert): tests/gloo/test_looped_experts.py; transformers' grouped-matmul
experts: tests/gloo/test_grouped_experts.py.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import pytest

import tpcompile
from tpcompile.tools.launch import run_on_ranks
from zoo.idioms import LM, ScaledTokensMoE, StackedMoE, example_inputs
from zoo.idioms.mlps import EinsumMoE

STACKED = ("w1", "w2", "w3")
CASES = {  # name -> (model factory, MoE class's stacked weights, expert count)
    "stacked_4": (lambda: LM(mlp=StackedMoE), STACKED, 4),
    "stacked_3": (lambda: LM(mlp=functools.partial(StackedMoE, n_experts=3)), STACKED, 3),
    "stacked_6": (lambda: LM(mlp=functools.partial(StackedMoE, n_experts=6)), STACKED, 6),
    "scaled_tokens_4": (lambda: LM(mlp=ScaledTokensMoE), ("gate_up", "down"), 4),
    "einsum_6": (lambda: LM(mlp=functools.partial(EinsumMoE, n_experts=6)), STACKED, 6),
}
AT = {2: list(CASES), 4: ["stacked_4", "stacked_6", "scaled_tokens_4", "einsum_6"]}  # 3 < 4
TOLERANCE = 1e-5


def _build(name: str):
    import torch
    torch.manual_seed(0)
    return CASES[name][0]()


@functools.lru_cache(maxsize=None)
def _report(name: str, world_size: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tpcompile.explain(_build(name), example_inputs(), world_size, experts="expert")


@pytest.mark.parametrize("name,world_size", [(n, ws) for ws, names in AT.items() for n in names])
def test_experts_are_cut_whole_and_reduced_once(name, world_size):
    _, stacked, n_experts = CASES[name]
    report = _report(name, world_size)
    per_rank = math.ceil(n_experts / world_size)
    for layer in range(2):
        module = f"layers.{layer}.mlp"
        assert report.experts[module].startswith("expert parallel"), report.experts
        for w in stacked:
            p = report.params[f"{module}.{w}"]
            assert p.style == "expert" and p.dim == 0, (w, p)
            counts = [s[0] for s in p.local_shapes]
            assert sum(counts) == n_experts and max(counts) == per_rank, counts
            if n_experts % world_size == 0:  # even: E / N experts' bytes, no more
                assert max(counts) <= 1.02 * n_experts / world_size
        forward = [c for c in report.collectives
                   if c.phase == "forward" and c.module.startswith(module)]
        assert [c.op for c in forward] == ["all_reduce"], forward
    assert f"{'layers.0.mlp'}: expert parallel" in str(report)
    assert not report.fallbacks


def test_tensor_is_the_default_and_says_so():
    report = tpcompile.explain(_build("stacked_4"), example_inputs(), 2)
    assert report.experts["layers.0.mlp"] == 'tensor parallel: experts="tensor"'
    assert report.params["layers.0.mlp.w1"].style == "colwise"
    assert report.params["layers.0.mlp.w2"].style == "rowwise"


def test_experts_tensor_already_cuts_experts_the_tokens_are_broadcast_over():
    """``einsum("td,ehd->eth")``: the experts are the first dim only the weight and the output
    carry, where ``experts="tensor"`` has always cut; explain says so."""
    report = tpcompile.explain(_build("einsum_6"), example_inputs(), 2)
    how = report.experts["layers.0.mlp"]
    assert how.startswith("expert parallel") and "broadcast over them" in how, how
    assert report.params["layers.0.mlp.w1"].style == "expert"


def test_more_ranks_than_experts_falls_back_to_tensor_with_the_reason():
    report = _report("stacked_3", 4)
    assert report.experts["layers.0.mlp"] == "tensor parallel: 3 experts: fewer than the 4 ranks"
    assert report.params["layers.0.mlp.w1"].style == "colwise"


@pytest.mark.parametrize("name,world_size,mode", [
    ("stacked_4", 2, "expert"), ("stacked_4", 4, "expert"),  # 1/2 vs 1/2, 1/4 vs 1/4: a tie
    ("stacked_6", 4, "tensor"),   # 2 of 6 experts (1/3) vs 16 of 64 features (1/4)
    ("stacked_3", 2, "tensor"),   # 2 of 3 experts vs 32 of 64 features
])
def test_auto_picks_the_smaller_share_of_expert_weights(name, world_size, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tpcompile.explain(_build(name), example_inputs(), world_size, experts="auto")
    how = report.experts["layers.0.mlp"]
    assert how.startswith(f"{mode} parallel") and "largest rank's share" in how, how
    assert report.params["layers.0.mlp.w1"].style == ("expert" if mode == "expert" else "colwise")


def test_unknown_mode_and_sequence_parallel_are_refused():
    with pytest.raises(ValueError, match="experts must be one of"):
        tpcompile.explain(_build("stacked_4"), example_inputs(), 2, experts="experts")
    with pytest.raises(ValueError, match='experts="expert" is planned without sequence parallelism'):
        tpcompile.explain(_build("stacked_4"), example_inputs(), 2, experts="expert",
                          sequence_parallel=True)


def _numerics_rank(rank: int, world_size: int, names: list[str]) -> dict:
    """On each gloo rank: name -> (output error, largest gradient error)."""
    from tpcompile.tools.numerics import compare

    out = {}
    for name in names:
        model = _build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = tpcompile.parallelize(model, example_inputs(), experts="expert")
            c = compare(model, tp, example_inputs())
            tp.zero_grad()
            other = compare(model, tp, example_inputs(3, 11, seed=1))
        out[name] = (max(c.output_err, other.output_err), max(c.max_grad_err, other.max_grad_err))
    return out


# 4 ranks with -m slow (CI time): the MoE idioms' 4-rank numerics run in CI (tests/gloo/test_idioms.py)
@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_outputs_and_every_gradient_equal_the_unsharded_model(world_size):
    names = AT[world_size]
    per_rank = run_on_ranks(f"{Path(__file__).resolve()}:_numerics_rank", world_size, names)
    for name in names:
        out_err = max(r[name][0] for r in per_rank)
        grad_err = max(r[name][1] for r in per_rank)
        assert out_err <= TOLERANCE and grad_err <= TOLERANCE, (name, out_err, grad_err)
