"""transformers' MoEs (grouped-matmul experts) under ``experts="tensor"`` and ``"expert"``.

Mixtral, Qwen3-MoE (5 experts: uneven over 2 and 4 ranks), OLMoE and a fine-grained
Qwen3-MoE (64 experts 16 wide, top-8), tiny random-init configs of ``zoo.hf_models.MOE``.
Planned (no process group): under ``"expert"`` every expert weight is cut by whole experts
and the largest rank holds at most 1.02x its ``ceil(E / N)`` experts' bytes, under
``"tensor"`` column -> row; each MoE block issues one forward all-reduce either way.
On gloo ranks: the output, every gradient and the weights after 3 AdamW steps equal the
unsharded model's. CI runs a subset (``-m slow`` runs every model, mode and world size).
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import pytest

import tpcompile
from tpcompile.tools.launch import run_on_ranks

MODELS = ("mixtral", "qwen3_moe", "olmoe", "qwen3_moe_64")
MODES = ("tensor", "expert")
TOLERANCE = 1e-5
STEP_TOLERANCE = 1e-4  # AdamW's g / sqrt(v) turns 1e-6 gradient noise into ~1e-5 of a step
EXPERTS = ("gate_up_proj", "down_proj")


def _slow_unless(case, ci) -> pytest.param:
    return pytest.param(*case, marks=() if case in ci else pytest.mark.slow)


@functools.lru_cache(maxsize=None)
def _report(name: str, world_size: int, mode: str):
    from zoo.hf_models import hf_inputs, hf_model

    model = hf_model(name)
    ids, kwargs = hf_inputs(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tpcompile.explain(model, (ids,), world_size, example_kwargs=kwargs, experts=mode)


PLAN_CI = {("mixtral", 2, "expert"), ("qwen3_moe_64", 4, "expert")}


@pytest.mark.parametrize("name,world_size,mode", [
    _slow_unless((n, ws, m), PLAN_CI) for n in MODELS for ws in (2, 4) for m in MODES])
def test_experts_are_cut_as_asked_and_reduced_once(name, world_size, mode):
    report = _report(name, world_size, mode)
    for layer in range(2):
        module = f"model.layers.{layer}.mlp"
        how = report.experts[f"{module}.experts"]
        assert how.startswith(f"{mode} parallel"), how
        for w in EXPERTS:
            p = report.params[f"{module}.experts.{w}"]
            n_experts = p.global_shape[0]
            if mode == "expert":
                per_rank = math.ceil(n_experts / world_size)
                counts = [s[0] for s in p.local_shapes]
                assert p.style == "expert" and sum(counts) == n_experts, (w, p)
                assert max(counts) <= 1.02 * per_rank, counts
                assert all(s[1:] == p.global_shape[1:] for s in p.local_shapes), p
            else:
                assert p.style == ("colwise" if w == "gate_up_proj" else "rowwise"), (w, p)
        forward = [c.op for c in report.collectives
                   if c.phase == "forward" and c.module.startswith(module)]
        assert forward == ["all_reduce"], (module, forward)
        assert report.params[f"{module}.gate.weight"].style == "replicate"
    assert not report.fallbacks, report.fallbacks


def _numerics_rank(rank: int, world_size: int, cases: list) -> dict:
    """On each gloo rank: (model, mode, sequence parallel) -> (output error, largest gradient
    error, largest weight error after 3 AdamW steps)."""
    from tpcompile.tools.numerics import compare
    from zoo.hf_models import hf_inputs, hf_model

    out = {}
    for name, mode, sp in cases:
        model = hf_model(name)
        ids, kwargs = hf_inputs(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = tpcompile.parallelize(model, (ids,), example_kwargs=kwargs, experts=mode,
                                       sequence_parallel=sp)
            c = compare(model, tp, (ids,), kwargs=kwargs, steps=3)
        out[name, mode, sp] = (c.output_err, c.max_grad_err, c.max_step_err)
    return out


# 5 experts over 2 ranks: 3 and 2; "auto" under sequence parallelism: expert-TP
NUMERICS_CI = {2: [("qwen3_moe", "expert", False), ("mixtral", "auto", True)], 4: []}


def _numerics_params() -> list:
    every = [(n, m, False) for n in MODELS for m in MODES] + [("qwen3_moe_64", "auto", True)]
    out = []
    for ws in (2, 4):
        ci = NUMERICS_CI[ws]
        if ci:
            out.append(pytest.param(ws, ci, id=f"{ws}"))
        out.append(pytest.param(ws, [c for c in every if c not in ci], id=f"{ws}-rest",
                                marks=pytest.mark.slow))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size,cases", _numerics_params())
def test_outputs_gradients_and_steps_equal_the_unsharded_model(world_size, cases):
    per_rank = run_on_ranks(f"{Path(__file__).resolve()}:_numerics_rank", world_size, cases)
    for case in cases:
        out_err, grad_err, step_err = (max(r[case][i] for r in per_rank) for i in range(3))
        assert out_err <= TOLERANCE and grad_err <= TOLERANCE, (case, out_err, grad_err)
        assert step_err <= STEP_TOLERANCE, (case, step_err)


@pytest.mark.parametrize("name,world_size", [("qwen3_moe_64", 4),
                                             pytest.param("mixtral", 2, marks=pytest.mark.slow)])
def test_auto_picks_the_cheaper_cut_of_the_cost_model(name, world_size):
    """``experts="auto"`` on grouped matmuls: the cut :func:`expert_costs` prices lower for
    the example's routed rows (tokens x top-k) on the CPU, and the line gives both prices."""
    from tpcompile.passes.planner.devices import DEVICES
    from tpcompile.passes.planner.experts.cost import expert_costs

    report = _report(name, world_size, "auto")
    for layer in range(2):
        module = f"model.layers.{layer}.mlp.experts"
        experts, width2, model_width = report.params[f"{module}.gate_up_proj"].global_shape
        rows = 2 * 16 * _top_k(name)  # hf_inputs: 2 x 16 tokens
        costs = expert_costs(experts, width2 // 2, model_width, rows, world_size, DEVICES["cpu"])
        pick = min(costs, key=lambda m: costs[m].seconds)
        how = report.experts[module]
        assert how.startswith(f"{pick} parallel") and "auto: cost model" in how, how
        assert report.params[f"{module}.gate_up_proj"].style == (
            "expert" if pick == "expert" else "colwise")


def _top_k(name: str) -> int:
    from zoo.hf_models import MOE

    config = MOE[name][2]
    return config["num_experts_per_tok"]


def test_auto_under_sequence_parallelism_is_expert_tp_and_says_why():
    """Whole experts would need every token where sequence parallelism brings shards: "auto"
    plans what "tensor" does under SP, and the line says so; "expert" is refused, naming the
    fallback. Its numerics: ``NUMERICS_CI``'s ("mixtral", "auto", True)."""
    from zoo.hf_models import hf_inputs, hf_model

    plans = {}
    for mode in ("auto", "tensor"):
        model = hf_model("mixtral")
        ids, kwargs = hf_inputs(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, plans[mode] = tpcompile.plan_model(model, (ids,), 2, example_kwargs=kwargs,
                                                  experts=mode, sequence_parallel=True)
    assert plans["auto"].params == plans["tensor"].params
    assert plans["auto"].conversions == plans["tensor"].conversions
    for layer in range(2):
        how = plans["auto"].experts[f"model.layers.{layer}.mlp.experts"]
        assert how.startswith("tensor parallel: auto: sequence_parallel=True"), how
        assert "all-to-all" in how, how
    with pytest.raises(ValueError, match='use experts="tensor" or "auto"'):
        tpcompile.plan_model(model, (ids,), 2, example_kwargs=kwargs, experts="expert",
                             sequence_parallel=True)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_explain_gives_the_rows_routed_to_each_ranks_experts(world_size):
    """The ``load`` of each block equals the routing read independently: the experts module's
    ``top_k_index`` counted per expert, summed over each rank's whole experts (5 experts: the
    first ranks hold one more)."""
    import torch

    from zoo.hf_models import hf_inputs, hf_model

    report = _report("qwen3_moe", world_size, "expert")
    model = hf_model("qwen3_moe")
    ids, kwargs = hf_inputs(model)
    routed = {}

    def record(layer, args):  # a pre-hook returning a value would replace the arguments
        routed.setdefault(layer, args[1].flatten())

    for layer in range(2):
        module = model.model.layers[layer].mlp.experts
        module.register_forward_pre_hook(lambda m, args, layer=layer: record(layer, args))
    with torch.no_grad():
        model(ids, **kwargs)
    for layer, index in routed.items():
        n_experts = model.config.num_experts
        counts = torch.bincount(index, minlength=n_experts).tolist()
        q, extra = divmod(n_experts, world_size)
        sizes = [q + (r < extra) for r in range(world_size)]
        starts = [sum(sizes[:r]) for r in range(world_size)]
        expected = [sum(counts[s:s + n]) for s, n in zip(starts, sizes)]
        module = f"model.layers.{layer}.mlp.experts"
        assert report.expert_load[module] == expected, (report.expert_load, expected)
        assert f"load: rows of the example routed to each rank's whole experts: " \
               f"{', '.join(map(str, expected))}" in str(report)
