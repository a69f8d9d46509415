"""The cost rule (passes/planner/chain_cost.py, refine/unpaid_chains.py): chains on one row per
sample are sharded only where they pay; every other plan is the one without the rule.

Plans only, no process group: the DiT idiom's conditioning chains kept whole with the numbers
that decided in ``explain``, the same model with the rule off sharding them, a per-sample chain
wide enough to pay sharded, a bad device refused by name, and representative language models
planned alike with the rule on and off (their chains run on token rows: never judged).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tpcompile
from bench.compat_plans import summary
from bench import hf_sweep
from tpcompile import plan_model
from tpcompile.errors import TPCompileError
from tpcompile.tools import models
from zoo import idioms

DIT = "dit_adaln_zero"
CONDITIONING = ("layers.0.emb.linear_1.weight", "layers.0.emb.linear_2.weight",
                "layers.1.emb.linear_1.weight", "layers.1.emb.linear_2.weight",
                "proj_out_1.weight")


@pytest.mark.parametrize("ws", [2, 4])
def test_dit_conditioning_is_kept_whole_by_cost_with_its_numbers(ws):
    report = tpcompile.explain(idioms.build(DIT), idioms.example_inputs(name=DIT), ws)
    kept = {k["node"]: k for k in report.kept_replicated}
    for w in CONDITIONING:
        reason = kept[w]["reason"]
        assert reason.startswith("kept whole by cost: sharding it (") and f"over {ws} ranks" in reason
        assert "us a step" in reason and "all-reduce(s)" in reason, reason
        assert kept[w]["source"].startswith("diffusion.py:"), kept[w]
        assert report.params[w].style == "replicate"
    layers = [m for m in report.megatron if m.layer]
    assert [(m.forward, m.backward) for m in layers] == [(2, 2), (2, 2)]
    assert not [m for m in report.megatron if not m.layer]  # nothing outside the blocks


def test_with_the_rule_off_the_dit_shards_its_timestep_embedder():
    """What the rule changes: without it the embedder MLP is a chain of its own."""
    _, plan = plan_model(idioms.build(DIT), idioms.example_inputs(name=DIT), 2, chain_cost="off")
    assert plan.params["layers.1.emb.linear_1.weight"].style == "colwise"
    assert plan.params["layers.1.emb.linear_2.weight"].style == "rowwise"


class WideConditioning(nn.Module):
    """A per-sample MLP 8192 wide (2 GiB of float32 weights) modulating token rows."""

    def __init__(self, dim=8192, width=32768, tokens_dim=64):
        super().__init__()
        self.up, self.down = nn.Linear(dim, width), nn.Linear(width, tokens_dim)
        self.proj = nn.Linear(tokens_dim, tokens_dim)

    def forward(self, x, c):
        return self.proj(x) * self.down(torch.relu(self.up(c)))[:, None]


def test_a_per_sample_chain_whose_weights_dominate_is_sharded():
    with torch.device("meta"):
        model = WideConditioning()
    inputs = (torch.randn(2, 16, 64, device="meta"), torch.randn(2, 8192, device="meta"))
    _, plan = plan_model(model, inputs, 2)
    assert (plan.params["up.weight"].style, plan.params["down.weight"].style) == \
        ("colwise", "rowwise"), plan.params["up.weight"].reason
    _, cpu = plan_model(model, inputs, 2, chain_cost="cpu")  # slower memory: pays more
    assert cpu.params["up.weight"].style == "colwise"


def test_an_unknown_device_is_refused_by_name():
    with pytest.raises(TPCompileError, match="chain_cost must be 'off' or a device"):
        plan_model(idioms.build(DIT), idioms.example_inputs(name=DIT), 2, chain_cost="tpu")


LMS = [("builtin", "llama"), ("builtin", "gpt2"), ("idiom", "rope_rotate_half"),
       ("idiom", "moe_stacked_bmm"), ("idiom", "per_layer_inputs"), ("hf", "GPT2LMHeadModel"),
       ("hf", "LlamaForCausalLM")]


@pytest.mark.parametrize("kind,name", LMS)
def test_language_model_plans_do_not_change(kind, name):
    """Their chains run on token rows: the rule never judges them (the whole corpus is compared
    before and after a planner change with ``python -m bench.compat_plans --corpus``)."""
    torch.manual_seed(0)
    if kind == "builtin":
        model = models.build(name)
        inputs = models.example_inputs(model)
    elif kind == "idiom":
        model, inputs = idioms.build(name), idioms.example_inputs(name=name)
    else:
        model, inputs = hf_sweep.build(name), (hf_sweep.example_ids(),)
    for ws in (2, 4):
        assert summary(model, inputs, ws, {}) == summary(model, inputs, ws, {"chain_cost": "off"})
