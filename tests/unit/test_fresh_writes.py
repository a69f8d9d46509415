"""In-place writes into buffers the model makes itself are planned out of place.

``functionalize_fresh_writes`` turns ``buf[..., :k].copy_(a)`` into a ``new_empty`` buffer
into ``slice_scatter`` and ``out.index_add_`` into ``zeros_like`` into ``index_add``, so the
planner shards through them: one forward all-reduce per block, not a PlanError (MLA's
``expand_kv``) or one all-reduce per expert (Mixtral's loop). The same modules run on gloo
ranks in tests/gloo/test_numerics.py (``fresh_buffer_*`` cases): outputs, every gradient
and three AdamW steps against the unsharded model at 2 and 4 ranks.
"""

import operator

import pytest
import torch
from torch import fx

from tpcompile.passes.pipeline import plan, run_passes
from tpcompile.passes.prepare.functionalize_fresh_writes import functionalize_fresh_writes_pass, out_of_place
from support import workers

aten = torch.ops.aten


def _planned(cls, world_size=2):
    torch.manual_seed(0)
    return plan(cls(), (torch.randn(2, 8, 32),), world_size)


def _targets(planned):
    return [n.target for n in planned.cap.gm.graph.nodes if n.op == "call_function"]


def _all_reduces(p):
    return [c for c in p.conversions if c.kind == "all_reduce"]


def test_out_of_place_overload_comes_from_torch_naming():
    assert out_of_place(aten.index_add_.default) is aten.index_add.default
    assert out_of_place(aten.copy_.default) is aten.copy.default
    assert out_of_place(aten.index_put_.default) is aten.index_put.default
    assert out_of_place(aten.index_add.default) is None  # already functional


@pytest.mark.parametrize("world_size", [2, 4])
def test_copy_into_slices_of_new_empty_is_sharded_by_heads(world_size):
    planned = _planned(workers.FreshBufferKeys, world_size)
    targets = _targets(planned)
    assert aten.copy_.default not in targets and targets.count(aten.slice_scatter.default) == 2
    p = planned.plan
    assert p.styles() == {"q.weight": "colwise", "k_own.weight": "colwise", "v.weight": "colwise",
                          "k_shared.weight": "replicate", "o.weight": "rowwise"}
    assert [c.user for c in _all_reduces(p)] == ["add"] and not p.fallbacks
    assert all(c.kind in ("all_reduce", "slice") for c in p.conversions)  # nothing gathered
    # backward: the block input (q, k_own, v) and the shared key part every head reads
    assert len(p.grad_syncs) == 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_index_add_into_zeros_like_reduces_once_after_the_loop(world_size):
    planned = _planned(workers.FreshBufferIndexAdd, world_size)
    assert aten.index_add_.default not in _targets(planned)
    p = planned.plan
    assert [s for n, s in p.styles().items() if n.endswith(".0.weight")] == ["colwise"] * 2
    assert [s for n, s in p.styles().items() if n.endswith(".2.weight")] == ["rowwise"] * 2
    assert len(_all_reduces(p)) == 1 and len(p.conversions) == 1 and not p.fallbacks
    # the experts' index_select of one token matrix: their gradients summed, then reduced once
    assert p.grad_syncs == {"reshape": ("index_select", "index_select_1")}


def _functionalized(gm: fx.GraphModule) -> fx.GraphModule:
    """The pass as the pipeline runs it: the runner regenerates the code if the graph changed,
    so calling the result runs the rewritten graph."""
    return run_passes(gm, [("functionalize_fresh_writes", functionalize_fresh_writes_pass)])[0]


def _graph(build) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    build(g, x)
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_buffer_viewed_before_the_write_stays_in_place():
    def build(g, x):
        buf = g.call_function(aten.zeros_like.default, (x,))
        early = g.call_function(aten.slice.Tensor, (buf, 0, 0, 1))  # sees the write later
        g.call_function(aten.add_.Tensor, (buf, x))
        g.output(g.call_function(operator.add, (early, buf)))
    gm = _functionalized(_graph(build))
    assert aten.add_.Tensor in [n.target for n in gm.graph.nodes]


def test_an_input_is_never_written_out_of_place():
    def build(g, x):
        g.output(g.call_function(aten.add_.Tensor, (x, x)))
    gm = _functionalized(_graph(build))
    assert aten.add_.Tensor in [n.target for n in gm.graph.nodes]


def test_later_readers_of_the_buffer_read_the_written_value():
    def build(g, x):
        buf = g.call_function(aten.zeros_like.default, (x,))
        g.call_function(aten.add_.Tensor, (buf, x))
        g.output(g.call_function(aten.mul.Tensor, (buf, 2)))
    gm = _functionalized(_graph(build))
    assert aten.add_.Tensor not in [n.target for n in gm.graph.nodes]
    x = torch.randn(3)
    assert torch.equal(gm(x), 2 * x)


class ForwardSubstitution(torch.nn.Module):
    """The gated delta rule's UT transform (Qwen3-Next / Qwen3.5 under export): rows of a
    computed ``ut = -a.tril(-1)`` rewritten in place, each from clones of earlier rows."""

    def forward(self, a):
        ut = -a.tril(-1)
        for i in range(1, a.shape[-1]):
            row = ut[..., i, :i].clone()
            sub = ut[..., :i, :i].clone()
            ut[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        return ut + torch.eye(a.shape[-1])


def test_writes_through_views_into_a_computed_result_become_scatters():
    a = torch.randn(2, 3, 4, 4)
    gm = torch.export.export(ForwardSubstitution(), (a,), strict=False).module()
    gm = _functionalized(gm)
    targets = [n.target for n in gm.graph.nodes]
    assert aten.copy_.default not in targets and aten.select_scatter.default in targets
    assert torch.allclose(gm(a), ForwardSubstitution()(a))


def test_a_whole_tensor_in_place_op_on_a_computed_result_stays_in_place():
    """``relu_`` / ``+=`` on an activation already run on each rank's shard (and save memory)."""
    def build(g, x):
        y = g.call_function(aten.mul.Tensor, (x, 2))
        g.call_function(aten.relu_.default, (y,))
        g.output(y)
    gm = _functionalized(_graph(build))
    assert aten.relu_.default in [n.target for n in gm.graph.nodes]


def test_a_computed_result_viewed_before_and_read_after_the_write_stays_in_place():
    def build(g, x):
        y = g.call_function(aten.mul.Tensor, (x, 2))
        early = g.call_function(aten.slice.Tensor, (y, 0, 1, 2))
        head = g.call_function(aten.slice.Tensor, (y, 0, 0, 1))
        g.call_function(aten.fill_.Scalar, (head, 0.0))
        g.output(g.call_function(operator.add, (early, y)))
    gm = _functionalized(_graph(build))
    assert aten.fill_.Scalar in [n.target for n in gm.graph.nodes]


@pytest.mark.parametrize("world_size", [2, 4])
def test_rotary_written_into_a_slice_of_normed_heads_is_sharded_by_heads(world_size):
    """CogView4: the write goes through ``.to(its own dtype)`` (the tensor itself) into a
    slice of the per-head norm's output: a ``slice_scatter``, q / k / v cut by heads, o by
    rows, one forward all-reduce (numerics: tests/gloo/test_numerics.py)."""
    planned = _planned(workers.RotaryWrittenIntoSlice, world_size)
    targets = _targets(planned)
    # each write: q[:, :, t:, :] is two slices (dims 0 and 2), each scattered back
    assert aten.copy_.default not in targets and targets.count(aten.slice_scatter.default) == 4
    styles = planned.plan.styles()
    assert {f: styles[f] for f in ("q.weight", "k.weight", "v.weight", "o.weight")} == {
        "q.weight": "colwise", "k.weight": "colwise", "v.weight": "colwise", "o.weight": "rowwise"}
    assert len(_all_reduces(planned.plan)) == 1 and not planned.plan.fallbacks

