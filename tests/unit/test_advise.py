"""tpcompile advise: its numbers against the plan itself, its decision, its cost model, its CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tpcompile.api import plan_model
from tpcompile.inspect.advise import SCHEMA, _repeat, advise
from tpcompile.inspect.costs import DEVICES, CostModel, Device
from tpcompile.inspect.explain import explain
from tpcompile.tools import models
from tpcompile.tools.cli import main

GPUS = 4
# 8 query / 2 KV heads: at TP 4 the KV heads are replicated inside the attention
CUSTOM = Device("test device", bf16_flops=100e12, fp32_flops=10e12, link_gbps=800, memory_gib=80,
                source="made up for the test")


@pytest.fixture(scope="module")
def llama():
    """Weights that outweigh activations (1 sequence of 4 tokens), so sharding them matters."""
    with torch.device("meta"):
        model = models.build("llama", n_layers=1, dim=128, hidden=512)
    return model, models.example_inputs(model, 1, 4)


@pytest.fixture(scope="module")
def advice(llama):
    model, inputs = llama
    return advise(model, inputs, GPUS, CostModel(CUSTOM))


def _plan_bytes(plan, trainable: set[str], dtype_size: int) -> int:
    """Per-rank trainable parameter bytes straight from a ShardingPlan, the largest rank."""
    seen, per_rank = set(), [0] * plan.world_size
    for name, p in plan.params.items():
        if name in trainable and p.aliases not in seen:
            seen.add(p.aliases)
            for r, shape in enumerate(p.local_shapes):
                per_rank[r] += math.prod(shape) * dtype_size
    return max(per_rank)


def test_every_degree_dividing_the_gpus_is_estimated(advice):
    assert [r.tp for r in advice.degrees] == [1, 2, 4]
    assert [r.dp for r in advice.degrees] == [4, 2, 1]


def test_parameter_bytes_and_collectives_are_the_plans(llama, advice):
    model, inputs = llama
    names = {n for n, _ in model.named_parameters()}
    for row in advice.degrees:
        batch = tuple(_repeat(x, row.tp) for x in inputs)
        _, plan = plan_model(model, batch, row.tp, dynamic=False)
        assert row.param_bytes == _plan_bytes(plan, names, 4), row.tp
        assert row.grad_bytes == row.param_bytes
        assert row.optimizer_bytes == 2 * row.param_bytes  # two fp32 moments of fp32 weights
        report = explain(model, batch, row.tp, dynamic=False)
        assert row.collectives == len(report.collectives)
        assert row.collective_bytes == sum(c.bytes for c in report.collectives)
    tp1 = advice.degrees[0]
    assert tp1.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert tp1.collectives == 0 and tp1.tp_sent_bytes == 0
    # the data-parallel all-reduce of TP 1's gradients over 4 replicas: 2(n-1)/n of them
    assert tp1.dp_sent_bytes == pytest.approx(tp1.grad_bytes * 2 * 3 / 4)


def test_matmul_flops_shrink_with_the_shards(advice):
    tp1, tp2, tp4 = advice.degrees
    # the same global batch: TP 2 runs twice the batch on half the weights, plus the LM head
    # (kept replicated) whole, so its FLOPs per rank sit between TP 1's and twice TP 1's
    assert tp1.flops < tp2.flops < 2 * tp1.flops
    assert tp2.activation_bytes > tp1.activation_bytes  # replicated activations, twice the batch
    for r in advice.degrees:
        assert r.compute_s == pytest.approx(r.flops / (CUSTOM.fp32_flops * 0.5))
        link = CUSTOM.link_gbps * 1e9 / 8 * 0.8
        assert r.tp_comm_s == pytest.approx(r.tp_sent_bytes / link + r.tp_ring_steps * 5e-6)
        assert r.step_s == pytest.approx(r.compute_s + r.tp_comm_s + r.dp_comm_s)


def test_the_advice_is_the_fastest_degree_that_fits(advice):
    assert all(r.fits for r in advice.degrees)
    assert advice.best == min(advice.degrees, key=lambda r: r.step_s).tp
    # memory for TP 4's need only: the decision moves to the one degree that fits
    tp4 = advice.degrees[-1]
    assert tp4.memory_bytes < min(r.memory_bytes for r in advice.degrees[:-1])
    tight = dataclasses.replace(CUSTOM, memory_gib=tp4.memory_bytes / 0.9 / 1024**3 * 1.0001)
    small = advice.under(CostModel(tight))
    assert [r.fits for r in small.degrees] == [False, False, True] and small.best == 4
    none = advice.under(CostModel(dataclasses.replace(CUSTOM, memory_gib=1e-6)))
    assert none.best is None and "no degree fits" in str(none)
    # a slow link: communication dominates, the degree sending the fewest bytes per rank wins
    # (here TP 4: no data-parallel gradient all-reduce of these weight-heavy ranks)
    slow = advice.under(CostModel(dataclasses.replace(CUSTOM, link_gbps=0.01)))
    assert slow.best == min(advice.degrees, key=lambda r: r.tp_sent_bytes + r.dp_sent_bytes).tp == 4
    # a free link: compute decides, and TP 1 computes no replicated matmul twice
    fast = advice.under(CostModel(dataclasses.replace(CUSTOM, link_gbps=1e12), step_latency=0))
    assert fast.best == min(advice.degrees, key=lambda r: r.flops).tp == 1


def test_inference_counts_the_kv_cache_instead_of_training_state(llama):
    model, inputs = llama
    infer = advise(model, inputs, 2, CostModel(CUSTOM, inference=True))
    tp1, tp2 = infer.degrees
    # 1 layer, K and V of 2 KV heads x 16 dims (not the 8 query heads they are expanded to)
    # at the example's batch 1 and sequence 4
    assert tp1.kv_cache_bytes == 2 * (1 * 2 * 4 * 16) * 4
    assert tp2.kv_cache_bytes == tp1.kv_cache_bytes * 2 // 2  # twice the batch, half the heads
    assert tp1.grad_bytes == tp1.optimizer_bytes == tp1.dp_sent_bytes == 0
    assert tp1.memory_bytes == tp1.param_bytes + tp1.buffer_bytes + tp1.kv_cache_bytes


def test_cli_prints_the_cost_model_and_json(capsys):
    assert main(["advise", "mlp", "--gpus", "2", "--device", "h100", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA H100 Tensor Core GPU datasheet" in text and "ring all-reduce 2(n-1)/n" in text
    assert "advice: TP " in text
    assert main(["advise", "mlp", "--gpus", "2", "--flops", "1e14", "--link-gbps", "400",
                 "--memory-gib", "16", "--json", "--quiet"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["schema"] == SCHEMA and obj["best"] in (1, 2)
    assert obj["cost"]["device"]["link_gbps"] == 400 and obj["cost"]["assumptions"]
    assert [d["tp"] for d in obj["degrees"]] == [1, 2]


def test_cli_refuses_a_device_without_numbers(capsys):
    assert main(["advise", "mlp", "--gpus", "2", "--flops", "1e14", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no --device and no --link-gbps, --memory-gib" in err and "--device a100|" in err
    assert main(["advise", "mlp", "--gpus", "0", "--device", "a100", "--quiet"]) == 2


def test_presets_state_their_source():
    for device in DEVICES.values():
        assert "datasheet" in device.source and device.bf16_flops > device.fp32_flops
