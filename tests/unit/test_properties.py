"""Property-based planning checks on random models, in this process (no process group).

For random stacks of Linear / activation / norm / residual / attention-like blocks at world
sizes 1-4: planning either succeeds or raises a ``TPCompileError`` that is not an internal
error; no sharding rule fails; the plan survives JSON; every rank's rewritten graph runs forward
and backward on fake tensors with the model's output shape; all ranks share one fingerprint; at
world size 1 the rewritten module computes exactly the model. Numerics at 2-4 ranks are
measured on gloo in tests/gloo/test_reliability.py; failures found there are kept in
tests/corpus and replayed here too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from support import rewrite_ranks
from tpcompile import TPCompileError
from tpcompile.runtime.agreement import digest
from tpcompile.tools.numerics import rel_err
from tpcompile.core.plan import ShardingPlan
from tpcompile.runtime.module import TPModule
from zoo import random_models


def check_planning(spec: dict, world_size: int) -> None:
    model, x = random_models.build(spec)
    try:
        plan, entries, graphs = rewrite_ranks(model, x, world_size, **random_models.options(spec))
    except TPCompileError as e:
        assert "internal error" not in str(e), str(e)
        return
    assert not [why for why in plan.fallbacks.values() if "rule failed" in why], plan.fallbacks
    assert ShardingPlan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert len({digest(e) for e in entries}) == 1
    expected = model(*x)
    for rank, gm in enumerate(graphs):
        params = [p for p in gm.parameters() if p.requires_grad]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            out = gm(*[mode.from_tensor(t) for t in x])
            assert out.shape == expected.shape and out.dtype == expected.dtype, rank
            if params:
                grads = torch.autograd.grad(out.double().pow(2).sum(), params, allow_unused=True)
                assert all(g is None or g.shape == p.shape for g, p in zip(grads, params))
    if world_size == 1:
        tp = TPModule(graphs[0], plan, 0, None)
        assert rel_err(tp(*x), expected) == 0.0


@settings(max_examples=50, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(spec=random_models.specs(), world_size=st.integers(1, 4))
def test_random_models_plan_and_rewrite_on_every_rank(spec, world_size):
    check_planning(spec, world_size)


@pytest.mark.parametrize("name", sorted(random_models.corpus()))
def test_corpus_plans_on_every_rank(name):
    case = random_models.corpus()[name]
    check_planning(case["spec"], case["world_size"])
