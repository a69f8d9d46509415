"""``dynamic=False`` planning (the fast path for planning large models) plans what
``parallelize``'s dynamic capture plans: every parameter's layout and every collective."""

from __future__ import annotations

import pytest

import tpcompile
from tpcompile.tools import models


@pytest.mark.parametrize("name, world_size", [("llama", 4), ("gpt2", 2), ("mlp", 4)])
def test_static_capture_plans_the_same_layouts_and_collectives(name, world_size):
    model = models.build(name)
    inputs = models.example_inputs(model, 2, 16)
    dynamic = tpcompile.explain(model, inputs, world_size)
    static = tpcompile.explain(model, inputs, world_size, dynamic=False)
    assert static.params == dynamic.params
    assert static.collectives == dynamic.collectives
    assert static.param_bytes_per_rank == dynamic.param_bytes_per_rank
    assert static.megatron == dynamic.megatron
    _, plan = tpcompile.plan_model(model, inputs, world_size, dynamic=False)
    assert {k: p.local_shapes for k, p in plan.params.items()} == {
        k: tuple(tuple(s) for s in e.local_shapes) for k, e in dynamic.params.items()
        if k in plan.params}
