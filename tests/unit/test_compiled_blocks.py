"""Repeated blocks of a rewritten graph outlined into one compiled block (no process group).

The compiled numerics, collective counts and the reuse of one compiled body are checked on
real gloo ranks in tests/gloo/test_compile.py; here, the split itself.
"""

from __future__ import annotations

import operator

import pytest
from torch import fx

from tpcompile.api import rewrite
from tpcompile.compile.inductor import (
    COMPILED_BLOCKS_WORKAROUND, REGIONS_WORKAROUND, compile_options,
)
from tpcompile.runtime.collectives import COLLECTIVE_FNS
from tpcompile.runtime.compiled_blocks import compiled_block_of_nodes, compiled_blocks_graph
from tpcompile.runtime.module import TPModule
from tpcompile.tools import models

LAYERS = 3


def _rewritten(name: str, layers: int) -> fx.GraphModule:
    model = models.build(name, n_layers=layers, dim=32, hidden=64, n_heads=4, n_kv_heads=2)
    gm, _, _ = rewrite(model, models.example_inputs(model), 2, 0)
    return gm


def _block_fns(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem
            and getattr(n.target, "__name__", "") == "compiled_block"]


@pytest.mark.parametrize("name, block", [("llama", "layers"), ("gpt2", "blocks")])
def test_identical_blocks_become_calls_of_one_shared_body(name, block):
    gm = _rewritten(name, LAYERS)
    outlined, calls = compiled_blocks_graph(gm)
    fns = _block_fns(outlined)
    assert calls == LAYERS and len(fns) == LAYERS
    assert len(set(fns)) == 1  # one body: what lets Dynamo trace it once
    blocks = set(compiled_block_of_nodes(gm.graph).values())
    assert {f"{block}.{i}" for i in range(LAYERS)} <= blocks


def test_collectives_join_their_block_and_each_block_call_gets_its_own_weights():
    gm = _rewritten("llama", 2)
    outlined, _ = compiled_blocks_graph(gm)
    owner = compiled_block_of_nodes(gm.graph)
    inserted = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_FNS]
    assert {owner.get(n) for n in inserted} == {"layers.0", "layers.1"}
    assert not any(n.target in COLLECTIVE_FNS for n in outlined.graph.nodes)  # all in the bodies
    # the outer graph still reads every weight; each call is handed its own block's weights
    assert ({n.target for n in outlined.graph.nodes if n.op == "get_attr"}
            == {n.target for n in gm.graph.nodes if n.op == "get_attr"})
    calls = [n for n in outlined.graph.nodes if n.op == "call_function" and n.target in
             _block_fns(outlined)]
    for i, call in enumerate(calls):
        read = {a.target for a in call.args if a.op == "get_attr"}
        assert read and all(t.startswith(f"layers.{i}.") for t in read), read


def test_a_single_block_is_left_flat():
    gm = _rewritten("llama", 1)
    assert compiled_blocks_graph(gm) == (gm, 0)


def test_outlined_module_shares_the_flat_module_tensors():
    gm = _rewritten("gpt2", 2)
    outlined, _ = compiled_blocks_graph(gm)
    flat = dict(gm.named_parameters())
    assert {n: p for n, p in outlined.named_parameters()} == flat
    assert all(outlined.get_parameter(n) is p for n, p in flat.items())


def test_the_former_region_names_are_the_compiled_block_ones():
    """docs/compile.md's former names still work: ``tp.compile_regions``, ``tp.region_calls``,
    ``tp.regional_graph_module``, ``compile_options(regions=True)``, ``REGIONS_WORKAROUND``."""
    model = models.build("llama", n_layers=2, dim=32, hidden=64, n_heads=4, n_kv_heads=2)
    gm, plan, _ = rewrite(model, models.example_inputs(model), 1, 0)
    tp = TPModule(gm, plan, 0, None)
    assert tp.region_calls == tp.compiled_block_calls == 2
    assert tp.regional_graph_module is tp.compiled_blocks_graph_module
    assert not tp.compile_regions
    tp.compile_regions = True
    assert tp.compiled_blocks is True
    assert REGIONS_WORKAROUND is COMPILED_BLOCKS_WORKAROUND
    assert (compile_options(regions=True) == compile_options(compiled_blocks=True)
            == {"allow_buffer_reuse": False} != compile_options())
