"""Capture reusing blocks (core/stamp.py, the default): the same graph and plan as a whole
export (``reuse_blocks=False``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from tpcompile.core.plan import PlanOptions
from tpcompile.passes import pipeline
from tpcompile.tools import models


def _both(model, world_size: int, **options):
    x = models.example_inputs(model)
    whole = pipeline.plan(model, x, world_size, options=PlanOptions(**options),
                          reuse_blocks=False)
    reused = pipeline.plan(model, x, world_size, options=PlanOptions(**options), reuse_blocks=True)
    return whole, reused


@pytest.mark.parametrize("name, options", [("llama", {}), ("gpt2", {"sequence_parallel": True})])
def test_reused_plan_equals_the_whole_graph_plan_on_4_layers(name, options):
    whole, reused = _both(models.build(name, n_layers=4), 4, **options)
    assert reused.cap.reused == ("layers" if name == "llama" else "blocks", 4)
    a, b = whole.plan, reused.plan
    assert list(a.params) == list(b.params)  # parameter by parameter
    for fqn in a.params:
        assert a.params[fqn] == b.params[fqn], fqn
    assert len(a.conversions) == len(b.conversions) > 0  # collective by collective
    for c, d in zip(a.conversions, b.conversions):
        assert c == d
    assert a.placements == b.placements and a.to_json() == b.to_json()
    assert reused.cap.gm.code == whole.cap.gm.code  # the same graph, node names included
    assert reused.cap.aliases == whole.cap.aliases and reused.cap.params == whole.cap.params


def test_blocks_that_differ_are_captured_whole_and_the_plan_says_why():
    model = models.build("llama", n_layers=4)
    model.layers[3].feed_forward.w2 = nn.Linear(128, 64, bias=False)  # same shapes, ...
    model.layers[3].feed_forward.w2.extra = 1                           # ... another attribute
    whole, reused = _both(model, 2)
    assert reused.cap.reused is None
    (note,) = reused.plan.notes
    assert note.startswith("layers: captured whole") and "block 3 differs from block 1 " \
        "(feed_forward.w2)" in note, note
    assert replace(reused.plan, notes=()).to_json() == whole.plan.to_json()
    x = models.example_inputs(model)
    assert torch.equal(reused.cap.gm(*x), whole.cap.gm(*x))


class ReadsTheSecondToLastBlock(nn.Module):
    """Its head reads ``layers[-2]``: block 1 of a 3-block copy, block 3 of the model."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return outs[-2] + x


def test_a_read_of_another_than_the_last_block_is_captured_whole():
    model, x = ReadsTheSecondToLastBlock(), (torch.randn(2, 8),)
    whole = pipeline.plan(model, x, 2, reuse_blocks=False)
    reused = pipeline.plan(model, x, 2, reuse_blocks=True)
    assert reused.cap.reused is None
    assert "reads a block other than the one before it" in reused.plan.notes[0]
    assert reused.cap.gm.code == whole.cap.gm.code


class Indexed(nn.Module):
    """A block that knows its index (as Hugging Face's ``layer_idx``) and, in the pattern
    ``kinds``, whether it adds its input back (two kinds of block that alternate)."""

    def __init__(self, index: int, kinds: str):
        super().__init__()
        self.layer_idx, self.residual = index, kinds[index % len(kinds)] == "r"
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) + x if self.residual else self.proj(x).relu()


class Stack(nn.Module):
    def __init__(self, n: int, kinds: str):
        super().__init__()
        self.layers = nn.ModuleList(Indexed(i, kinds) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("n, kinds, reused", [(4, "r", True), (8, "rp", True), (12, "rrp", True),
                                              (6, "rp", False), (8, "rrp", False)])
def test_blocks_with_their_index_and_alternating_kinds_are_stamped_by_period(n, kinds, reused):
    """``layer_idx`` is no difference; a pattern that repeats is stamped a period at a time
    (three periods exported); a pattern that does not divide the blocks, or repeats fewer than
    four times, is captured whole with a note."""
    model, x = Stack(n, kinds), (torch.randn(2, 8),)
    whole, stamped = pipeline.plan(model, x, 2, reuse_blocks=False), pipeline.plan(model, x, 2)
    assert (stamped.cap.reused is not None) == reused
    assert stamped.cap.gm.code == whole.cap.gm.code
    assert replace(stamped.plan, notes=()).to_json() == whole.plan.to_json()
    assert bool(stamped.plan.notes) != reused
    torch.testing.assert_close(stamped.cap.gm(*x), whole.cap.gm(*x), rtol=0, atol=0)


class Counts(nn.Module):
    """Its forward counts the blocks (a scale) or reads the last one by index."""

    def __init__(self, by_index: bool):
        super().__init__()
        self.by_index = by_index
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if self.by_index:
            return x + self.layers[len(self.layers) - 1].bias
        return x / len(self.layers)


@pytest.mark.parametrize("by_index", [False, True])
def test_a_forward_that_counts_or_indexes_its_blocks_gets_the_whole_graph(by_index):
    """The exported copy's list has the whole list's length: a count traces as in the whole
    model; an index past the kept blocks fails that capture, and the model is captured whole."""
    model, x = Counts(by_index), (torch.randn(2, 8),)
    whole, stamped = pipeline.plan(model, x, 2, reuse_blocks=False), pipeline.plan(model, x, 2)
    assert (stamped.cap.reused is not None) != by_index
    assert ("did not capture" in " ".join(stamped.plan.notes)) == by_index
    assert stamped.cap.gm.code == whole.cap.gm.code
    torch.testing.assert_close(stamped.cap.gm(*x), whole.cap.gm(*x), rtol=0, atol=0)
    torch.testing.assert_close(stamped.cap.gm(*x), model(*x), rtol=0, atol=0)


def test_a_forward_that_branches_on_its_index_is_not_stamped():
    """An index attribute the forward only passes on (a cache's layer_idx) is no difference;
    one it branches on is: block 5 would run code blocks 1 and 2 never showed."""
    from tpcompile.core.block_kinds import _only_passed

    class Passes(nn.Module):
        def forward(self, x, cache=None):
            return cache.update(x, self.layer_idx) if cache is not None else x

    class Branches(nn.Module):
        def forward(self, x):
            return x * 2 if self.layer_idx == 5 else x

    assert _only_passed(Passes, "layer_idx")
    assert not _only_passed(Branches, "layer_idx")
    model, x = nn.Sequential(), (torch.randn(2, 8),)
    model.layers = nn.ModuleList(Branching(i) for i in range(6))
    model.forward = lambda x: [x := layer(x) for layer in model.layers][-1]
    stamped = pipeline.plan(model, x, 2)
    assert stamped.cap.reused is None and stamped.plan.notes
    torch.testing.assert_close(stamped.cap.gm(*x), model(*x), rtol=0, atol=0)


class Branching(nn.Module):
    """Block 5 of six adds a ReLU: blocks 1 and 2, the ones exported, never show it."""

    def __init__(self, index: int):
        super().__init__()
        self.layer_idx, self.proj = index, nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).relu() if self.layer_idx == 5 else self.proj(x)


def test_the_static_cache_generate_captures_is_stamped_with_each_blocks_cache():
    """The wrapper ``generate`` captures (runtime/static_cache.py) keeps layer i's KV cache on
    itself as ``key_cache_{i}`` (its ``per_block_attributes``) and every layer reads one
    position buffer: a 6-layer Llama's prefill is exported three blocks deep and stamped, each
    block with its own cache, into the graph and plan a whole export gives."""
    transformers = pytest.importorskip("transformers")
    from tpcompile.runtime.static_cache import StaticCacheLM

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=6, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    wrapper = StaticCacheLM(transformers.LlamaForCausalLM(config).eval(), 2, 64)
    meta = dict(device="meta", dtype=torch.long)
    example = (torch.empty(2, 3, **meta), torch.empty(2, 64, **meta), torch.empty(2, 3, **meta),
               torch.empty(3, **meta))
    whole = pipeline.plan(wrapper, example, 2, reuse_blocks=False)
    reused = pipeline.plan(wrapper, example, 2, reuse_blocks=True)
    assert reused.cap.reused == ("model.model.layers", 6)
    assert reused.cap.gm.code == whole.cap.gm.code and reused.plan.to_json() == whole.plan.to_json()
    caches = {n.target: [u.meta["nn_module_stack"] for u in n.users]
              for n in reused.cap.gm.graph.find_nodes(op="get_attr") if "_cache_" in n.target}
    assert len(caches) == 12 and all(
        any(f"layers.{target.rpartition('_')[2]}" in path for path, _ in stack.values())
        for target, users in caches.items() for stack in users)
