"""The pass runner and the graph copy the rewrite works on (passes/pipeline.py).

Both skip code generation where they can (0.07-0.1 s per recompile at 2,000 nodes); these
tests check that what they skip could not have changed what the module runs.
"""

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from tpcompile.passes.pipeline import copy_graph, run_passes

aten = torch.ops.aten


def _doubling() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(aten.mul.Tensor, (x, 2)))
    return fx.GraphModule(torch.nn.Module(), g)


def _triple(gm: fx.GraphModule) -> fx.GraphModule:
    """Edits the graph: ``x * 2`` -> ``x * 3`` (returns the module: taken as changed)."""
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    mul.args = (mul.args[0], 3)
    return gm


def _untouched(gm: fx.GraphModule) -> PassResult:
    return PassResult(gm, False)


def test_code_is_regenerated_only_after_a_pass_changed_the_graph():
    gm = _doubling()
    code = gm.code
    gm, _ = run_passes(gm, [("untouched", _untouched)])
    assert gm.code is code  # nothing to regenerate
    gm, _ = run_passes(gm, [("triple", _triple), ("untouched", _untouched)])
    x = torch.randn(4)
    assert "3" in gm.code and torch.equal(gm(x), 3 * x)  # the change is in the code that runs


def test_recorded_snapshots_show_each_change():
    gm, records = run_passes(_doubling(), [("untouched", _untouched), ("triple", _triple)],
                             record=True)
    assert records[0].before == records[0].after == records[1].before
    assert records[1].after != records[1].before and "3" in records[1].after


def test_a_copy_runs_like_the_original_and_is_rewritten_apart_from_it():
    gm = _doubling()
    copied = copy_graph(gm)
    x = torch.randn(4)
    assert copied.graph is not gm.graph and torch.equal(copied(x), gm(x))
    run_passes(copied, [("triple", _triple)])
    assert torch.equal(copied(x), 3 * x) and torch.equal(gm(x), 2 * x)
    assert "3" in copied.code and "3" not in gm.code
