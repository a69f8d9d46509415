"""Advanced indexing by a constant run of indices is planned as a slice (``constant_index_as_slice``).

Falcon-7B picks its one key head out of the fused projection with ``qkv[..., [-2], :]``; the
idiom ``fused_qkv_mqa_indexed`` (tests/gloo/test_idioms.py) checks the plan and the numbers on
gloo ranks. Here: which indices become slices, and that the graph still computes the model.
"""

import pytest
import torch
from torch import nn

from tpcompile.core.capture import capture
from tpcompile.passes.prepare.constant_index_as_slice import constant_index_as_slice_pass

aten = torch.ops.aten


class Picks(nn.Module):
    def __init__(self, pick):
        super().__init__()
        self.pick = pick

    def forward(self, x):
        y = self.pick(x)
        y.mul_(2)  # an in-place write on the result must not reach x
        return y + x.sum()


CASES = {  # name -> (x[...] picker, becomes a slice)
    "last_but_one": (lambda x: x[..., [-2], :], True),
    "run": (lambda x: x[:, [1, 2, 3]], True),
    "single_first": (lambda x: x[[0]], True),
    "descending": (lambda x: x[:, [2, 1]], False),
    "gap": (lambda x: x[:, [0, 2]], False),
    "mask": (lambda x: x[:, torch.tensor([True, False, True, False, True])], False),
    "two_indices": (lambda x: x[[0], [1]], False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_constant_runs_become_slices_and_the_graph_computes_the_model(name):
    pick, sliced = CASES[name]
    model, x = Picks(pick), torch.randn(3, 5, 4)
    gm, changed = constant_index_as_slice_pass(capture(model, (x,), dynamic=False).gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert changed == sliced and (aten.index.Tensor in targets) != sliced, targets
    assert (aten.clone.default in targets) == sliced, targets
    gm.recompile()
    torch.testing.assert_close(gm(x.clone()), model(x.clone()), rtol=0, atol=0)


def test_a_dim_of_dynamic_size_keeps_its_index():
    """x[:, [1, 2]] on a dim of symbolic size: a slice would clip where the index raises."""
    gm, changed = constant_index_as_slice_pass(capture(Picks(CASES["run"][0]), (torch.randn(3, 5, 4),)).gm)
    assert not changed and aten.index.Tensor in [n.target for n in gm.graph.nodes]


def test_an_index_computed_at_run_time_stays_an_index():
    class Gathered(nn.Module):
        def forward(self, x, i):
            return x[:, i]

    x, i = torch.randn(3, 5), torch.tensor([1, 2])
    gm, changed = constant_index_as_slice_pass(capture(Gathered(), (x, i)).gm)
    assert not changed and aten.index.Tensor in [n.target for n in gm.graph.nodes]
