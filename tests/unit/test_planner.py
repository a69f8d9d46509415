"""Plans of the built-in models, computed without any process group."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import tpcompile
from tpcompile import ShardingPlan

from tpcompile.tools import models
from tpcompile.api import plan_model
from tpcompile.passes import pipeline
from tpcompile.core.placement import Replicate, Shard
from tpcompile.passes.planner.rules import rule_for_target

from support import workers


def plan_for(name, ws, **overrides):
    model = models.build(name, **overrides)
    return plan_model(model, models.example_inputs(model), ws)[1]


def all_reduces(plan):
    return [c for c in plan.conversions if c.kind == "all_reduce"]


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_mlp_is_column_then_row(ws):
    plan = plan_for("mlp", ws)
    styles = plan.styles()
    assert styles["blocks.0.fc1.weight"] == styles["blocks.0.fc1.bias"] == "colwise"
    assert styles["blocks.0.fc2.weight"] == "rowwise"
    assert styles["blocks.0.fc2.bias"] == styles["blocks.0.norm.weight"] == "replicate"
    assert len(all_reduces(plan)) == 2  # one per block
    # the row-parallel bias is added once, after the all-reduce
    (ar,) = [c for c in all_reduces(plan) if c.value.startswith("linear_1")]
    assert ar.user == "linear_1_bias"


def test_gpt2_fused_qkv_is_sharded_per_chunk():
    plan = plan_for("gpt2", 2)
    p = plan.params["blocks.0.attn.c_attn.weight"]
    assert p.style == "colwise" and p.local_shapes[0] == (96, 64)
    ranges = plan.specs.ranges(p.placement.layout)
    assert ranges[0] == ((0, 32), (64, 96), (128, 160))  # q, k, v halves, not rows 0..95
    assert plan.styles()["blocks.0.attn.c_proj.weight"] == "rowwise"
    assert plan.styles()["lm_head.weight"] == "replicate"  # tied with the embedding


@pytest.mark.parametrize("ws,kv_style", [(2, "colwise"), (4, "replicate"), (8, "replicate")])
def test_llama_gqa(ws, kv_style):
    plan = plan_for("llama", ws)
    styles = plan.styles()
    assert styles["layers.0.attention.wq.weight"] == "colwise"
    assert styles["layers.0.attention.wk.weight"] == kv_style
    assert styles["layers.0.attention.wo.weight"] == "rowwise"
    # with fewer kv heads than ranks wk stays whole and its gradient comes out whole: the
    # gradients of k and v are synced instead (in the attention input's all-reduce), and the
    # input's own sync is read by wq's linear alone
    assert not plan.params["layers.0.attention.wk.weight"].grad_sync
    kv_synced = "linear_2" in plan.grad_syncs  # v = wv(x), synced where it is read
    assert kv_synced == (kv_style == "replicate")
    assert plan.grad_syncs["mul_1"] == (("linear",) if kv_synced else ("linear", "linear_1", "linear_2"))
    q_local = plan.params["layers.0.attention.wq.weight"].local_shapes[0][0]
    assert q_local == 64 // ws


def test_lm_head_stays_replicated_with_a_reason():
    plan = plan_for("llama", 2)
    assert plan.styles()["output.weight"] == "replicate"
    assert "linear_14" in plan.replicated["output.weight"]
    assert "all-gather where the model's output linear_14 is S(2)" in plan.replicated["output.weight"]
    assert "output.weight" in str(plan)


def test_plan_is_json_and_deterministic():
    a, b = plan_for("llama", 4), plan_for("llama", 4)
    assert a.to_json() == b.to_json()
    again = ShardingPlan.from_json(a.to_json())
    assert again.to_json() == a.to_json()
    assert again.specs.ranges(again.params["layers.0.attention.wq.weight"].placement.layout) == \
        a.specs.ranges(a.params["layers.0.attention.wq.weight"].placement.layout)


def test_unknown_op_on_sharded_data_is_gathered_and_reported():
    model = workers.UnruledOpAttention()
    _, plan = plan_model(model, (torch.randn(2, 8, 32),), 2)
    assert plan.styles()["qkv.weight"] == "colwise"
    assert plan.styles()["proj.weight"] == "rowwise"
    assert "cumprod" in plan.fallbacks and "no sharding rule" in plan.fallbacks["cumprod"]
    assert "fallback: cumprod" in str(plan)
    gathers = [c for c in plan.conversions if c.kind == "all_gather"]
    assert [c.user for c in gathers] == ["cumprod"]


def test_unknown_op_between_matmuls_keeps_the_chain_replicated():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(torch.cumprod(torch.sigmoid(self.fc1(x)), -1))

    _, plan = plan_model(Odd(), (torch.randn(4, 16),), 2)
    assert set(plan.styles().values()) == {"replicate"}
    assert plan.replicated  # and explain says why


def test_placements_are_recorded_per_node():
    plan = plan_for("llama", 2)
    assert isinstance(plan.placement("linear"), Shard)  # wq output
    assert isinstance(plan.placement("embedding"), Replicate)


class PartialPlusNumber(nn.Module):
    """A row-parallel output (a partial sum) plus a number, and a mean over a column shard."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = self.up(x)
        scale = h.mean(-1, keepdim=True) + 1.0  # a per-rank term of the mean, then + 1 once
        return self.down(h) + 2.0, scale


def test_a_number_is_added_to_a_partial_sum_once_after_it_is_reduced():
    cap, plan = plan_model(PartialPlusNumber(), (torch.randn(2, 3, 8),), 2)
    adds = [n.name for n in cap.gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    means = [n.name for n in cap.gm.graph.nodes if n.target is torch.ops.aten.mean.dim]
    assert plan.styles()["up.weight"] == "colwise" and plan.styles()["down.weight"] == "rowwise"
    assert str(plan.placements[means[0]]) == "P"  # linear in its input: no gather of h
    assert all(str(plan.placements[a]) == "R" for a in adds)
    assert sorted(c.value for c in all_reduces(plan)) == ["linear_1", means[0]]


class UnruledOps(nn.Module):
    """Ops without an entry in the rule table between a column and a row linear: ``square``
    (ruled by torch's pointwise tag); ``view_as``, ``logsumexp`` over the sequence and ``pad``
    of the sequence (a causal shift), planned through their decompositions."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = torch.square(torch.relu(self.up(x)))
        h = torch.nn.functional.pad(h, (0, 0, 1, 0))[:, :-1]
        h = h - torch.logsumexp(h, 1, keepdim=True)
        return self.down(h.view_as(h.detach()))


def _decomposed(model: nn.Module, inputs: tuple, world_size: int):
    """``(cap, plan, ops)``: ``ops`` the ops ``decompose_unruled`` decomposed, from the facts
    it returned in each replan round (the graph carries no record of them)."""
    planned = pipeline.plan(model, inputs, world_size)
    rounds = next(r.facts for r in planned.records if r.name == "decompose_unruled")
    return planned.cap, planned.plan, {op for made in rounds for op in made.values()}


def test_ops_without_rules_are_planned_through_their_decompositions():
    cap, plan, decomposed = _decomposed(UnruledOps(), (torch.randn(2, 5, 8),), 2)
    assert plan.styles() == {"up.weight": "colwise", "down.weight": "rowwise"}
    assert not plan.fallbacks and len(all_reduces(plan)) == 1
    assert decomposed == {"aten.logsumexp.default", "aten.view_as.default", "aten.pad.default"}


def test_decompositions_are_a_pass_of_their_own_in_the_diff():
    result = tpcompile.diff(UnruledOps(), (torch.randn(2, 5, 8),), 2, passes=True)
    sections = {s.split("\n", 1)[0]: s for s in str(result).split("# === pass ")[1:]}
    added = [line for line in sections["decompose_unruled"].splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    assert any("aten.amax" in line for line in added)  # logsumexp's first op
    assert "(no change)" in sections["functionalize_fresh_writes"]


class VectorNorms(nn.Module):
    """``F.normalize`` of heads cut by a column linear (head_dim whole: the shard passes) and
    over the whole cut features before the row linear (a per-token statistic)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = torch.nn.functional.normalize(self.up(x).unflatten(-1, (4, 4)), dim=-1).flatten(-2)
        return self.down(torch.nn.functional.normalize(h, dim=-1))


def test_vector_norms_over_a_cut_dim_are_decomposed_there_alone():
    cap, plan, decomposed = _decomposed(VectorNorms(), (torch.randn(2, 5, 8),), 2)
    assert plan.styles() == {"up.weight": "colwise", "down.weight": "rowwise"}
    # two values all-reduced: the statistic (read by the root and its zero test), the row output
    assert not plan.fallbacks and len({c.value for c in all_reduces(plan)}) == 2
    targets = [n.target for n in cap.gm.graph.nodes]
    assert targets.count(torch.ops.aten.linalg_vector_norm.default) == 1  # per head: kept
    assert "aten.linalg_vector_norm.default" in decomposed


@pytest.mark.parametrize("ord, dim, keepdim", [(2, -1, True), (2, None, False), (3.5, (0, 2), True),
                                               (1, 1, False)])
def test_vector_norm_decomposition_is_the_norm(ord, dim, keepdim):
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    norm = rule_for_target(torch.ops.aten.linalg_vector_norm.default).decomposition
    torch.testing.assert_close(norm(x, ord, dim, keepdim),
                               torch.linalg.vector_norm(x, ord, dim, keepdim))
    x = torch.zeros(3, 4, requires_grad=True)  # a zero vector: gradient 0, not NaN
    norm(x, ord, -1).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


class Counts(nn.Module):
    """A column-parallel activation's histogram, and a router's expert counts (torchtitan's
    ``histc`` of int64 top-k indices, which needs zoo/histc.py's CPU kernel)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.gate = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        h = self.up(x)
        picked = self.gate(x).topk(2, -1).indices
        experts = torch.histc(picked.view(-1), bins=4, min=0, max=4)
        return self.down(h) * torch.histc(h, bins=8).sum(), experts


def test_histc_reads_its_input_whole_and_counts_replicated():
    from zoo.histc import install

    install()
    _, plan = plan_model(Counts(), (torch.randn(4, 8),), 2)
    # the rule reads a column shard as R: the planner weighs that gather and keeps up whole
    assert "histc (top level) reads linear_bias S(1) as R" in plan.replicated["up.weight"]
    assert not plan.fallbacks and not plan.conversions
    assert all(isinstance(plan.placement(n), Replicate) for n in ("histc", "histc_1"))
    x = torch.randint(0, 4, (64,))
    assert torch.equal(torch.histc(x, bins=4, min=0, max=4), torch.bincount(x, minlength=4))


def _idiom_plan(name, ws, **options):
    from zoo import idioms
    return plan_model(idioms.build(name), idioms.example_inputs(name=name), ws, **options)[1]


@pytest.mark.parametrize("ws", [2, 4])
def test_parallel_block_residual_first_carries_its_sum(ws):
    """x + attn(ln(x)) + mlp(ln(x)): the residual enters wo's and w2's partial sum as rank 0's
    share (a summand conversion, no collective), the sum is reduced once per block, and the
    residual's gradient needs no sync (only the norm's output, read by both chains, has one)."""
    plan = _idiom_plan("parallel_block_residual_first", ws)
    summands = [c for c in plan.conversions if c.kind == "summand"]
    assert [c.value for c in summands] == ["embedding"]  # block 1 adds block 0's sum partially
    assert len({c.value for c in all_reduces(plan)}) == 2  # one per block
    assert set(plan.grad_syncs) == {"layer_norm", "layer_norm_1"}
    assert ShardingPlan.from_json(plan.to_json()).conversions == plan.conversions


def test_carried_sums_leave_sequential_blocks_and_sequence_parallelism_alone():
    """One partial sum per residual add (Llama) gains nothing; under sequence parallelism the
    residual stream is cut by position and nothing is carried."""
    assert not [c for c in plan_for("llama", 2).conversions if c.kind == "summand"]
    sp = _idiom_plan("parallel_block_residual_first", 2, sequence_parallel=True)
    assert not [c for c in sp.conversions if c.kind == "summand"]
