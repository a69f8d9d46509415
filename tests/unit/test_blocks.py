"""outline_blocks: each repeated block becomes a called submodule, and nothing else changes."""

from __future__ import annotations

import types

import pytest
import torch
from torch import fx

from tpcompile.api import rewrite
from tpcompile.errors import TPCompileError
from tpcompile.runtime.blocks import outline_blocks, repeated_block_paths
from tpcompile.tools import models


def _calls(gm: fx.GraphModule) -> list[str]:
    """The graph's computations in execution order, entering called blocks."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), fx.GraphModule):
            out += _calls(gm.get_submodule(node.target))
        elif node.op == "call_function":
            out.append(getattr(node.target, "__name__", str(node.target)))
    return [c for c in out if c != "getitem"]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_blocks_become_calls_with_the_same_names_values_and_collectives(name):
    model = models.build(name, n_layers=3)
    x = models.example_inputs(model)
    flat, _, _ = rewrite(model, x, 2, 0)  # rank 0 of 2: its collectives, never run here
    out, _, _ = rewrite(model, x, 2, 0)
    before = _calls(flat)
    blocks = outline_blocks(types.SimpleNamespace(graph_module=out))
    assert [n for n, _ in out.named_parameters()] == [n for n, _ in flat.named_parameters()]
    assert len(blocks) == 3 and all(isinstance(b, fx.GraphModule) for b in blocks)
    assert [n.target for n in out.graph.nodes if n.op == "call_module"][-3:] == \
        repeated_block_paths(out) == [f"{'layers' if name == 'llama' else 'blocks'}.{i}" for i in range(3)]
    assert _calls(out) == before  # every op and collective, in the same order

    single, _, _ = rewrite(model, x, 1, 0)  # no collectives: run both and compare exactly
    ref = single(*x)
    outline_blocks(types.SimpleNamespace(graph_module=single))
    assert torch.equal(single(*x), ref)


def test_a_model_without_repeated_blocks_is_refused():
    model = models.build("mlp", n_layers=1)
    gm, _, _ = rewrite(model, models.example_inputs(model), 1, 0)
    with pytest.raises(TPCompileError, match="no ModuleList"):
        outline_blocks(types.SimpleNamespace(graph_module=gm))


class RootParameter(torch.nn.Module):
    """A parameter on the root module itself (ViT's pos_embed): FSDP2 replaces it there."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(4, 8))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x + self.pos)


def test_a_root_parameter_replaced_on_the_module_is_the_one_the_graph_reads():
    from tpcompile.runtime.module import TPModule

    model, x = RootParameter(), torch.randn(2, 4, 8)
    gm, plan, _ = rewrite(model, (x,), 1, 0)
    tp = TPModule(gm, plan, 0, None)
    tp.pos = torch.nn.Parameter(torch.zeros(4, 8))  # what fully_shard and to_empty do
    assert torch.equal(tp.graph_module(x), model.proj(x))
