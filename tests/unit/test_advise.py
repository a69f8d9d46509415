"""tpcompile advise: its numbers against the plan itself, its decision, its cost model, its CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tpcompile.api import plan_model
from tpcompile.inspect.advise.advise import SCHEMA, _repeat, advise
from tpcompile.inspect.advise.costs import CostModel
from tpcompile.passes.planner.devices import PRESETS, Device
from tpcompile.inspect.explain.explain import explain
from tpcompile.tools import models
from tpcompile.tools.cli import main

GPUS = 4
# 8 query / 2 KV heads: at TP 4 the KV heads are replicated inside the attention
CUSTOM = Device("test device", bf16_flops=100e12, fp32_flops=10e12, link_gbps=800, memory_gib=80,
                source="made up for the test")


@pytest.fixture(scope="module")
def llama():
    """Weights that outweigh activations (1 sequence of 4 tokens), so sharding them matters;
    two layers, so that there are blocks to checkpoint and to shard as FSDP units."""
    with torch.device("meta"):
        model = models.build("llama", n_layers=2, dim=128, hidden=512)
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


def _row(advice, **want):
    return next(r for r in advice.configs if all(getattr(r, k) == v for k, v in want.items()))


def _plain(advice) -> list:
    """One row per degree: replicated data parallelism, no checkpointing, no SP."""
    return [r for r in advice.configs if not r.fsdp and r.checkpointing == "none" and not r.sp]


def test_every_configuration_is_weighed(advice):
    got = {(r.tp, r.dp, r.fsdp, r.checkpointing, r.sp) for r in advice.configs}
    want = {(tp, GPUS // tp, fsdp, mode, sp) for tp in (1, 2, 4) for sp in (False, True)
            for fsdp in (False, True) for mode in ("none", "selective", "full")
            if (tp > 1 or not sp) and (GPUS // tp > 1 or not fsdp)}
    assert got == want and len(advice.configs) == len(want)


def test_parameter_bytes_and_collectives_are_the_plans(llama, advice):
    model, inputs = llama
    names = {n for n, _ in model.named_parameters()}
    for row in _plain(advice):
        batch = tuple(_repeat(x, row.tp) for x in inputs)
        _, plan = plan_model(model, batch, row.tp, dynamic=False)
        assert row.param_bytes == _plan_bytes(plan, names, 4), row.tp
        assert row.grad_bytes == row.param_bytes
        assert row.optimizer_bytes == 2 * row.param_bytes  # two fp32 moments of fp32 weights
        report = explain(model, batch, row.tp, dynamic=False)
        assert row.collectives == len(report.collectives)
        assert row.collective_bytes == sum(c.bytes for c in report.collectives)
    tp1 = _plain(advice)[0]
    assert tp1.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert tp1.collectives == 0 and tp1.tp_sent_bytes == 0
    # the data-parallel all-reduce of TP 1's gradients over 4 replicas: 2(n-1)/n of them
    assert tp1.dp_sent_bytes == pytest.approx(tp1.grad_bytes * 2 * 3 / 4)


def test_fsdp_shards_the_training_state_and_gathers_it(llama, advice):
    model, _ = llama
    for plain in _plain(advice)[:2]:  # TP 1 x 4 and TP 2 x 2 data-parallel ranks
        row = _row(advice, tp=plain.tp, fsdp=True, checkpointing="none", sp=False)
        dp = row.dp
        # each tensor's dim 0 cut in dp (these divide evenly)
        assert row.param_bytes == row.grad_bytes == plain.param_bytes // dp
        assert row.optimizer_bytes == plain.optimizer_bytes // dp
        assert row.activation_bytes == plain.activation_bytes
        # parameters all-gathered in forward and backward, gradients reduce-scattered
        assert row.dp_sent_bytes == pytest.approx(3 * plain.param_bytes * (dp - 1) / dp)
        # the largest unit (a layer, or the root: embedding, final norm, head) gathered whole,
        # with its gradients
        if plain.tp == 1:
            layer = sum(p.numel() * 4 for n, p in model.named_parameters()
                        if n.startswith("layers.0."))
            root = sum(p.numel() * 4 for n, p in model.named_parameters()
                       if not n.startswith("layers."))
            assert row.fsdp_unit_bytes == 2 * max(layer, root)
        assert row.memory_bytes == (row.param_bytes + row.buffer_bytes + row.grad_bytes
                                    + row.optimizer_bytes + row.activation_bytes
                                    + row.fsdp_unit_bytes)


def test_checkpointing_trades_activations_for_recomputation(advice):
    for plain in _plain(advice):
        full = _row(advice, tp=plain.tp, fsdp=False, checkpointing="full", sp=False)
        selective = _row(advice, tp=plain.tp, fsdp=False, checkpointing="selective", sp=False)
        assert full.activation_bytes < selective.activation_bytes <= plain.activation_bytes
        # selective keeps every matmul's output: nothing of them recomputed; full recomputes
        # the layer's matmuls (all but the LM head's) once more
        assert selective.flops == plain.flops
        assert plain.flops < full.flops < plain.flops * 4 / 3


def test_matmul_flops_shrink_with_the_shards(advice):
    tp1, tp2, tp4 = _plain(advice)
    # the same global batch: TP 2 runs twice the batch on half the weights, plus the LM head
    # (kept replicated) whole, so its FLOPs per rank sit between TP 1's and twice TP 1's
    assert tp1.flops < tp2.flops < 2 * tp1.flops
    assert tp2.activation_bytes > tp1.activation_bytes  # replicated activations, twice the batch
    for r in advice.configs:
        assert r.compute_s == pytest.approx(r.flops / (CUSTOM.fp32_flops * 0.5))
        link = CUSTOM.link_gbps * 1e9 / 8 * 0.8
        assert r.tp_comm_s == pytest.approx(r.tp_sent_bytes / link + r.tp_ring_steps * 5e-6)
        assert r.step_s == pytest.approx(r.compute_s + r.tp_comm_s + r.dp_comm_s)


def test_the_advice_is_the_fastest_configuration_that_fits(advice):
    assert all(r.fits for r in advice.configs)
    assert advice.best_config == min(advice.configs, key=lambda r: (r.step_s, r.tp))
    # memory for the smallest need only: the decision moves to the one configuration that fits
    least = min(advice.configs, key=lambda r: r.memory_bytes)
    tight = dataclasses.replace(CUSTOM, memory_gib=least.memory_bytes / 0.9 / 1024**3 * 1.0001)
    small = advice.under(CostModel(tight))
    assert [i for i, r in enumerate(small.configs) if r.fits] == [small.best]
    assert small.best_config.memory_bytes == least.memory_bytes
    none = advice.under(CostModel(dataclasses.replace(CUSTOM, memory_gib=1e-6)))
    assert none.best is None and "no configuration fits" in str(none)
    # a slow link: communication dominates, the configuration sending the fewest bytes wins
    slow = advice.under(CostModel(dataclasses.replace(CUSTOM, link_gbps=0.01)))
    fewest = min(r.tp_sent_bytes + r.dp_sent_bytes for r in advice.configs)
    assert slow.best_config.tp_sent_bytes + slow.best_config.dp_sent_bytes == fewest
    # a free link: compute decides, and TP 1 computes no replicated matmul twice
    fast = advice.under(CostModel(dataclasses.replace(CUSTOM, link_gbps=1e12), step_latency=0))
    assert fast.best_config.tp == 1 and fast.best_config.checkpointing != "full"
    assert "tensor parallelism does not pay here" in str(fast)


def test_inference_counts_the_kv_cache_instead_of_training_state(llama):
    model, inputs = llama
    infer = advise(model, inputs, 2, CostModel(CUSTOM, inference=True))
    tp1, tp2 = infer.configs
    # 2 layers, K and V of 2 KV heads x 16 dims (not the 8 query heads they are expanded to)
    # at the example's batch 1 and sequence 4
    assert tp1.kv_cache_bytes == 2 * 2 * (1 * 2 * 4 * 16) * 4
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
    assert obj["schema"] == SCHEMA == "tpcompile.advise/3"
    assert obj["experts"] == []  # no MoE block: no expert choice
    assert obj["cost"]["device"]["link_gbps"] == 400 and obj["cost"]["assumptions"]
    assert {d["tp"] for d in obj["configs"]} == {1, 2}
    assert obj["configs"][obj["best"]]["tp"] in (1, 2)
    assert main(["advise", "mlp", "--gpus", "2", "--device", "h100", "--checkpointing", "full",
                 "--fsdp", "yes", "--sequence-parallel", "--json", "--quiet"]) == 0
    rows = json.loads(capsys.readouterr().out)["configs"]
    assert {(d["tp"], d["fsdp"], d["checkpointing"], d["sp"]) for d in rows} == \
        {(1, True, "full", False), (2, False, "full", True)}


def test_cli_refuses_a_device_without_numbers(capsys):
    assert main(["advise", "mlp", "--gpus", "2", "--flops", "1e14", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no --device and no --link-gbps, --memory-gib" in err and "--device a100|" in err
    assert main(["advise", "mlp", "--gpus", "0", "--device", "a100", "--quiet"]) == 2
    assert main(["advise", "mlp", "--gpus", "2", "--device", "a100", "--checkpointing", "some",
                 "--quiet"]) == 2
    assert "--checkpointing takes none, selective and full" in capsys.readouterr().err


def test_presets_state_their_source():
    for device in PRESETS.values():
        assert "datasheet" in device.source and device.bf16_flops > device.fp32_flops


def test_bad_choices_and_real_weights_are_refused(llama):
    model, inputs = llama
    with pytest.raises(ValueError, match="checkpointing takes one or more of"):
        advise(model, inputs, 2, CostModel(CUSTOM), checkpointing=["some"])
    with pytest.raises(ValueError, match="fsdp takes one or more of"):
        advise(model, inputs, 2, CostModel(CUSTOM), fsdp=())
    with pytest.raises(ValueError, match='build it under torch.device\\("meta"\\)'):
        advise(models.build("llama", n_layers=1, dim=32, hidden=64), inputs, 2, CostModel(CUSTOM))
