"""One rank's rewritten graph, built without a process group: constants, collectives, shards."""

from __future__ import annotations

import pytest
import torch

from tpcompile.tools import models
from tpcompile.runtime import collectives as C
from tpcompile.api import rewrite
from tpcompile.inspect.trace import trace_rewrite
from tpcompile.inspect.traffic import list_collectives
from zoo import idioms


def calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


@pytest.mark.parametrize("ws", [2, 4])
def test_llama_view_constants_are_localized(ws):
    model = models.build("llama", n_layers=1)
    gm, plan, _ = rewrite(model, models.example_inputs(model), ws, rank=0)
    code = gm.code
    assert f"view.default(linear, [sym_size_int, sym_size_int_1, {8 // ws}, 8])" in code
    assert len(calls(gm, C.all_reduce)) == 2
    # one gradient sync per chain; at 4 ranks (2 kv heads) the attention's also sums k and v's
    assert len(calls(gm, C.copy_into_chain)) == {2: 2, 4: 1}[ws]
    assert len(calls(gm, C.copy_all_into_chain)) == {2: 0, 4: 1}[ws]
    assert gm.get_submodule("layers.0.attention").wq.weight.shape == (64 // ws, 64)


def test_gpt2_split_becomes_local_split_with_sizes():
    model = models.build("gpt2", n_layers=1)
    gm, _, _ = rewrite(model, models.example_inputs(model), 2, rank=1)
    assert "split_with_sizes.default(linear, [32, 32, 32], 2)" in gm.code


def test_uneven_ranks_get_their_own_constants():
    model = models.build("llama", n_layers=1, dim=48, n_heads=6, n_kv_heads=2, hidden=100, vocab=97)
    codes = [rewrite(model, models.example_inputs(model), 4, rank=r)[0].code for r in range(4)]
    assert "sym_size_int_1, 2, 8])" in codes[0] and "sym_size_int_1, 1, 8])" in codes[3]


def test_rewritten_graph_runs_at_world_size_one_per_rank_shapes():
    """The rank-0 graph of a 1-rank plan computes exactly the model (no collectives at all)."""
    model = models.build("gpt2")
    x = models.example_inputs(model)
    gm, _, records = rewrite(model, x, 1, rank=0, record=True)
    assert [r.name for r in records] == ["localize", "insert_collectives",
                                         "drop_unowned_experts", "clone_converted_writes", "materialize_params",
                                         "fuse_bias", "fuse_sequence_linears", "retarget_device"]
    torch.testing.assert_close(gm(*x), model(*x), rtol=0, atol=0)


def _backward_syncs(gm) -> list[list[str]]:
    """The values of each gradient all-reduce (one per copy_into_chain / copy_all_into_chain)."""
    return ([[n.args[0].name] for n in calls(gm, C.copy_into_chain)]
            + [[v.name for v in n.args[0]] for n in calls(gm, C.copy_all_into_chain)])


def test_a_value_computed_from_a_synced_value_shares_its_all_reduce():
    """Llama 4 scales each expert's copy of the tokens by its routing score: the product is
    computed from the tokens, not from a reader of their synced copy, so the shared expert's
    input and the routed tokens are reduced in one all-reduce per MoE block."""
    gm, _, _ = rewrite(idioms.build("moe_scaled_tokens"), idioms.example_inputs(), 2, rank=0)
    syncs = _backward_syncs(gm)
    assert len(syncs) == 2 * idioms.LAYERS, syncs
    assert sum(len(s) == 2 for s in syncs) == idioms.LAYERS, syncs


def test_a_value_made_before_the_blocks_joins_the_first_blocks_all_reduce():
    """Gemma 4's per-layer inputs are made once before the blocks and read by each: their
    gradient is whole before the first block's input is synced, so that all-reduce carries it."""
    gm, _, _ = rewrite(idioms.build("per_layer_inputs"), idioms.example_inputs(), 2, rank=0)
    syncs = _backward_syncs(gm)
    assert len(syncs) == 3 * idioms.LAYERS, syncs
    made_before = {n.name for n in gm.graph.nodes if n.op == "call_function"
                   and not any("layers" in path for path, _ in (n.meta.get("nn_module_stack") or {}).values())}
    early = [s for s in syncs if made_before & set(s)]
    assert len(early) == 1 and len(early[0]) > 1, syncs


def test_a_bucketed_sync_names_every_value_it_reduces():
    """explain and the communication benchmark attribute a shared all-reduce to its last value
    but list all of them, so a bucket is matched against Megatron's bound by any member."""
    model = idioms.build("moe_scaled_tokens")
    trace = trace_rewrite(model, idioms.example_inputs(), 2, copy_weights=False)
    backward = [c for c in list_collectives(trace) if c.phase == "backward"]
    shared = [c for c in backward if len(c.values) == 2]
    assert len(shared) == idioms.LAYERS, backward
    assert all(c.node == c.values[-1] for c in backward)
