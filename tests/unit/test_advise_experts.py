"""advise's expert choice for MoE models: each block's two cuts priced at each TP degree by
``experts="auto"``'s cost model, the cheaper named, and the plan's own choice beside it; in the
text and in the JSON (``tpcompile.advise/3``'s ``experts``)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tpcompile.inspect.advise.advise import advise
from tpcompile.inspect.advise.costs import CostModel
from tpcompile.passes.planner.devices import DEVICES
from tpcompile.passes.planner.devices import device_for
from tpcompile.passes.planner.experts.cost import expert_costs
from zoo.moe_blocks import moe_block

# (experts, width, top-k, model width), tokens: 16 fine-grained experts of a small block
SHAPE, TOKENS, GPUS = (16, 64, 4, 64), 64, 4


def _advise(gpus: int, **options):
    """advise on the block built on meta: no checkpointing, no FSDP weighed."""
    experts, width, top_k, model_width = SHAPE
    with torch.device("meta"):
        block = moe_block(experts, width, top_k, model_width)
        x = torch.zeros(1, TOKENS, model_width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return advise(block, (x,), gpus, CostModel(DEVICES["h100"]), checkpointing=None,
                      fsdp=False, **options)


@pytest.fixture(scope="module")
def advice():
    return _advise(GPUS, experts="auto", sequence_parallel=False)


def test_each_degree_prices_both_cuts_and_plans_the_cheaper(advice):
    experts, width, top_k, model_width = SHAPE
    assert [c.tp for c in advice.experts] == [2, 4]  # TP 1 cuts nothing
    for c in advice.experts:
        # at degree d the TP group runs d x the example batch: its routed rows
        rows = c.tp * TOKENS * top_k
        costs = expert_costs(experts, width, model_width, rows, c.tp, device_for("meta"))
        cheaper = min(costs, key=lambda m: costs[m].seconds)
        assert (c.experts, c.width, c.model_width, c.rows) == (experts, width, model_width, rows)
        assert c.tensor_ms == pytest.approx(1e3 * costs["tensor"].seconds)
        assert c.expert_ms == pytest.approx(1e3 * costs["expert"].seconds)
        assert c.cheaper == cheaper and c.planned.startswith(f"{cheaper} parallel"), c


def test_text_and_json_carry_the_choice(advice):
    text = str(advice)
    for c in advice.experts:
        assert f"TP {c.tp}: {c.module} ({c.experts} experts of width {c.width}" in text, text
    obj = json.loads(advice.to_json())
    assert obj["schema"] == "tpcompile.advise/3"
    assert [e["cheaper"] for e in obj["experts"]] == [c.cheaper for c in advice.experts]
    assert advice.under(CostModel(DEVICES["a100"])).experts == advice.experts


def test_whole_experts_are_weighed_without_sequence_parallelism():
    """``experts="expert"`` is planned without SP only: advise weighs it so, rather than
    failing on the SP rows it weighs by default."""
    advice = _advise(2, experts="expert")
    assert {r.sp for r in advice.configs} == {False}
    assert [c.planned.split(":")[0] for c in advice.experts] == ["expert parallel"]
