"""Autocast scopes in forward are inlined and planned, and keep their autocast state.

``inline_autocast`` replaces export's ``wrap_with_autocast`` call by the scope's ops between
``torch.amp._enter_autocast`` and ``_exit_autocast``: the q / k projections normalised in
float32 inside ``torch.autocast(..., enabled=False)`` are column-parallel (before, the call
had no rule and gathered them), and run under an outer bfloat16 autocast the scope still
computes in float32, as the model does. The idiom ``qk_norm_autocast_off`` runs on gloo ranks
(tests/gloo/test_idioms.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from tpcompile.passes.pipeline import plan


class Scope(nn.Module):
    """q / k cut by heads, normalised per head with autocast off, k then mixed by a matmul
    whose dtype shows which autocast state it ran in."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(32, 32, bias=False) for _ in range(3))
        self.wo = nn.Linear(32, 32, bias=False)
        self.mix = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, 4, 8) for w in (self.wq, self.wk, self.wv))
        with torch.autocast("cpu", enabled=False):
            q, k = F.normalize(q, dim=-1), self.mix(F.normalize(k, dim=-1))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, 32))


class Nested(nn.Module):
    """A bfloat16 scope inside a scope with autocast off."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            a = self.w(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                b = self.w(x)
        return a, b


def _planned(cls=Scope):
    torch.manual_seed(0)
    model = cls()
    return model, plan(model, (torch.randn(2, 8, 32),), 2)


def test_scopes_are_inlined_between_enter_and_exit():
    _, planned = _planned(Nested)
    targets = [n.target for n in planned.cap.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.higher_order.wrap_with_autocast not in targets
    assert targets.count(torch.amp._enter_autocast) == 2
    assert targets.count(torch.amp._exit_autocast) == 2
    assert not [name for name, _ in planned.cap.gm.named_children() if name.startswith("submod")]


def test_projections_normalised_in_a_scope_are_column_parallel():
    _, planned = _planned()
    styles = planned.plan.styles()
    assert styles["wq.weight"] == styles["wk.weight"] == styles["wv.weight"] == "colwise"
    assert styles["wo.weight"] == "rowwise"


def test_scopes_keep_their_autocast_state_under_an_outer_autocast():
    """(Scope under an outer autocast would feed bfloat16 q / k into its float32 scope,
    which needs a cast there that export asserts as captured: not a graph to run so.)"""
    x = torch.randn(3, 5, 32)
    for cls, outers in ((Scope, (False,)), (Nested, (False, True))):
        model, planned = _planned(cls)
        for outer in outers:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer):
                want, got = model(x), planned.cap.gm(x)
            want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
            for w, g in zip(want, got, strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w), (cls.__name__, outer)
