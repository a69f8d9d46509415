"""Capture gives one graph per computation: the order model code ran in does not show."""

from __future__ import annotations

import torch
from torch import nn

from tpcompile.api import plan_model
from tpcompile.core.capture import capture


class Branches(nn.Module):
    """Independent branches run in ``order``: what a loop over a set of strings does on ranks
    with different hash seeds (transformers' Gemma 3 rotary tables)."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.up = nn.ModuleDict({k: nn.Linear(8, 16) for k in sorted(order)})
        self.down = nn.ModuleDict({k: nn.Linear(16, 8) for k in sorted(order)})

    def forward(self, x):
        outs = {k: self.down[k](torch.relu(self.up[k](x))) for k in self.order}
        return sum(outs[k] for k in sorted(outs))


def test_branch_order_changes_neither_graph_nor_plan():
    x = torch.randn(2, 3, 8)
    a, b = Branches(["full", "sliding", "local"]), Branches(["local", "full", "sliding"])
    b.load_state_dict(a.state_dict())
    (cap_a, plan_a), (cap_b, plan_b) = plan_model(a, (x,), 2), plan_model(b, (x,), 2)
    assert cap_a.gm.code == cap_b.gm.code
    assert plan_a.to_json() == plan_b.to_json()
    assert plan_a.styles()["up.full.weight"] == "colwise"


class ReadThenWrite(nn.Module):
    """A read of a buffer before an in-place write to it, used only after the write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(4))

    def forward(self, x):
        before = self.state * 3          # pure, but must not move past the write below
        self.state.add_(x.sum())
        noise = torch.nn.functional.dropout(x, 0.5, training=True)
        again = torch.nn.functional.dropout(x, 0.5, training=True)
        return before + self.state + noise.sum() + 2 * again.sum()


def test_reads_stay_before_writes_and_random_draws_keep_their_order():
    model, x = ReadThenWrite(), torch.randn(4)
    gm = capture(model, (x,), dynamic=False).gm
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    add_ = next(i for i, t in enumerate(order) if t is torch.ops.aten.add_.Tensor)
    mul = next(i for i, t in enumerate(order) if t is torch.ops.aten.mul.Tensor)
    assert mul < add_
    results = []
    for module in (model, gm):  # same draws in the same order: equal results
        module.get_buffer("state").fill_(1)
        torch.manual_seed(0)
        results.append(module(x))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_names_are_exports_own_scheme_in_the_new_order():
    from tpcompile.tools import models
    model = models.build("llama", n_layers=1)
    gm = capture(model, models.example_inputs(model)).gm
    linears = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears == ["linear"] + [f"linear_{i}" for i in range(1, len(linears))]
