"""Repeated blocks of a rewritten graph outlined into one shared region (no process group).

The compiled numerics, collective counts and the reuse of one compiled body are checked on
real gloo ranks in tests/gloo/test_regions.py; here, the split itself.
"""

from __future__ import annotations

import operator

import pytest
from torch import fx

from tpcompile.api import rewrite
from tpcompile.runtime.collectives import COLLECTIVE_FNS
from tpcompile.runtime.regions import region_of_nodes, regional_graph
from tpcompile.tools import models

LAYERS = 3


def _rewritten(name: str, layers: int) -> fx.GraphModule:
    model = models.build(name, n_layers=layers, dim=32, hidden=64, n_heads=4, n_kv_heads=2)
    gm, _, _ = rewrite(model, models.example_inputs(model), 2, 0)
    return gm


def _region_fns(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem
            and getattr(n.target, "__name__", "") == "region"]


@pytest.mark.parametrize("name, block", [("llama", "layers"), ("gpt2", "blocks")])
def test_identical_blocks_become_calls_of_one_shared_body(name, block):
    gm = _rewritten(name, LAYERS)
    regional, calls = regional_graph(gm)
    fns = _region_fns(regional)
    assert calls == LAYERS and len(fns) == LAYERS
    assert len(set(fns)) == 1  # one body: what lets Dynamo trace it once
    regions = set(region_of_nodes(gm.graph).values())
    assert {f"{block}.{i}" for i in range(LAYERS)} <= regions


def test_collectives_join_their_block_and_each_block_call_gets_its_own_weights():
    gm = _rewritten("llama", 2)
    regional, _ = regional_graph(gm)
    region_of = region_of_nodes(gm.graph)
    inserted = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_FNS]
    assert {region_of.get(n) for n in inserted} == {"layers.0", "layers.1"}
    assert not any(n.target in COLLECTIVE_FNS for n in regional.graph.nodes)  # all in the bodies
    # the outer graph still reads every weight; each call is handed its own block's weights
    assert ({n.target for n in regional.graph.nodes if n.op == "get_attr"}
            == {n.target for n in gm.graph.nodes if n.op == "get_attr"})
    calls = [n for n in regional.graph.nodes if n.op == "call_function" and n.target in
             _region_fns(regional)]
    for i, call in enumerate(calls):
        read = {a.target for a in call.args if a.op == "get_attr"}
        assert read and all(t.startswith(f"layers.{i}.") for t in read), read


def test_a_single_block_is_left_flat():
    gm = _rewritten("llama", 1)
    assert regional_graph(gm) == (gm, 0)


def test_regional_module_shares_the_flat_module_tensors():
    gm = _rewritten("gpt2", 2)
    regional, _ = regional_graph(gm)
    flat = dict(gm.named_parameters())
    assert {n: p for n, p in regional.named_parameters()} == flat
    assert all(regional.get_parameter(n) is p for n, p in flat.items())
