"""Checkpointed regions: marked at capture, outlined into torch.utils.checkpoint calls, and a
region that cannot be outlined named in a warning (no process group needed)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

import tpcompile
from tpcompile.api import _checkpoint_regions
from tpcompile.core.capture import capture
from tpcompile.core.checkpoint_marks import REGION
from tpcompile.passes import pipeline
from tpcompile.passes.rewrite.checkpoint_regions import checkpointed_graph, regions_of


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.use_reentrant)
        return x.tanh()


class Plain(Checkpointed):
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.tanh()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_capture_marks_each_checkpoint_call(use_reentrant):
    gm = capture(Checkpointed(use_reentrant), (torch.randn(2, 4, 8),)).gm
    regions = regions_of(gm)
    assert list(regions) == ["checkpoint 0 (layers.0)", "checkpoint 1 (layers.1)"]
    assert [len(nodes) for nodes in regions.values()] == [4, 4]  # linear, relu, linear, add
    tanh = [n for n in gm.graph.nodes if n.target == torch.ops.aten.tanh.default]
    assert tanh[0].meta[REGION] is None


def test_model_without_checkpoints_is_captured_unmarked():
    gm = capture(Plain(False), (torch.randn(2, 4, 8),)).gm
    assert not any(REGION in n.meta for n in gm.graph.nodes)


def _marked(fn, regions: dict[str, str | None]) -> fx.GraphModule:
    """``fn`` traced, each op's region set by its target's name (absent: inserted later)."""
    gm = fx.symbolic_trace(fn)
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if node.op == "call_function" and name in regions:
            node.meta[REGION] = regions[name]
    return gm


def _convex(x):
    return torch.add(torch.neg(torch.relu(x)), x).tanh()


def test_region_outlined_into_a_checkpoint_call_with_inserted_op():
    gm = _marked(_convex, {"relu": "r", "add": "r", "tanh": None})  # neg: inserted, joins r
    x = torch.randn(4, requires_grad=True)
    kept, dropped = checkpointed_graph(gm)
    assert (kept, dropped) == (["r"], [])
    assert "checkpointed_region" in gm.code and "torch.neg" not in gm.code
    out = gm(x)
    out.sum().backward()
    ref = x.detach().clone().requires_grad_()
    _convex(ref).sum().backward()
    torch.testing.assert_close(out, _convex(x.detach()))
    torch.testing.assert_close(x.grad, ref.grad)


def test_the_outline_pass_returns_its_regions_and_writes_no_graph_meta():
    """What the pass found is its record's value, not a key left on the graph for the caller."""
    gm = _marked(_convex, {"relu": "r", "add": "r", "tanh": None})
    before = dict(gm.meta)
    _, records = pipeline.outline(gm, None)
    assert [(r.name, r.facts) for r in records] == [("checkpoint_regions", (["r"], []))]
    assert gm.meta == before


def _read_back(x):
    a = torch.relu(x)
    return torch.add(a, torch.neg(a))


def test_region_read_back_from_outside_stays_inline_with_a_warning():
    gm = _marked(_read_back, {"relu": "r", "neg": None, "add": "r"})
    with pytest.warns(UserWarning, match="r is not checkpointed.*neg.*read back inside"):
        kept, dropped = _checkpoint_regions(gm, None)
    assert kept == [] and [name for name, _ in dropped] == ["r"]
    assert "checkpointed_region" not in gm.code


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_block_mode_regions_are_the_repeated_blocks(mode):
    gm = capture(Plain(False), (torch.randn(2, 4, 8),)).gm
    assert list(regions_of(gm, mode)) == ["layers.0", "layers.1"]


def test_unknown_mode_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="activation_checkpointing must be one of"):
        tpcompile.parallelize(Block(), (torch.randn(2, 8),), activation_checkpointing="some")


def test_explain_lists_the_checkpointed_regions():
    report = tpcompile.explain(Checkpointed(False), (torch.randn(2, 4, 8),), world_size=2)
    assert report.checkpointing == {"kept": ["checkpoint 0 (layers.0)", "checkpoint 1 (layers.1)"],
                                    "dropped": []}
    assert "activation checkpointing: 2 region(s) recomputed in backward" in str(report)
    plain = tpcompile.explain(Plain(False), (torch.randn(2, 4, 8),), world_size=2,
                              activation_checkpointing="full")
    assert plain.checkpointing["kept"] == ["layers.0", "layers.1"]
    assert "activation checkpointing" not in str(tpcompile.explain(
        Plain(False), (torch.randn(2, 4, 8),), world_size=2))


class TwoLinears(nn.Module):
    def __init__(self, d: int, h: int, selective: bool = False):
        super().__init__()
        self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(h, 1, bias=False)
        self.selective = selective

    def body(self, x):
        return self.down(torch.relu(self.up(x)))

    def forward(self, x):
        if not self.selective:
            return self.body(x)
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        keep_matmuls = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        return checkpoint(self.body, x, use_reentrant=False, context_fn=keep_matmuls)


def test_activation_memory_sees_what_backward_holds():
    """Held after the forward: relu's output (the second matmul's saved input) and the output;
    a selective checkpoint keeping the matmuls holds their outputs in its own cache (which
    saved_tensors_hooks do not see). The peak includes the gradients."""
    from tpcompile.tools.numerics import activation_memory, saved_activation_bytes

    n, d, h = 8, 16, 32
    x = torch.randn(n, d)
    plain, selective = TwoLinears(d, h), TwoLinears(d, h, selective=True)
    held, peak = activation_memory(plain, (x,))
    assert held == (n * h + n) * 4
    assert peak >= held + (d * h + h) * 4
    held, _ = activation_memory(selective, (x,))
    assert held == (n * h + n) * 4  # the matmuls' outputs in its cache (down's is the output)
    assert saved_activation_bytes(selective, (x,)) < held
