"""Filling one rank's shards without a process group: full state dicts, safetensors, the
modules' initialisers, meta-device builds (device constants, buffers), and the errors."""

from __future__ import annotations

import pytest
import torch

import tpcompile
from tpcompile.tools import models
from tpcompile.api import rewrite
from tpcompile.state.checkpoint import ShardedParam, sharded_state_dict
from torch import fx

from tpcompile.passes.rewrite.retarget_device import baked_devices, retarget_device_pass
from tpcompile.passes.rewrite.materialize_params import take_shard
from tpcompile.runtime.module import TPModule
from tpcompile.core.shards import placements_by_fqn

CFG = {"sdpa": False}  # explicit attention: torch.full(..., device=x.device) in the graph


def one_rank(ws: int, rank: int, meta: bool = True, name: str = "llama") -> tuple:
    """(model, rank's TPModule) for a built-in model; no process group, no forward."""
    with torch.device("meta" if meta else "cpu"):
        model = models.build(name, **CFG)
    x = models.example_inputs(models.build(name, **CFG))
    gm, plan, _ = rewrite(model, tuple(t.to("meta") for t in x) if meta else x, ws, rank)
    return model, TPModule(gm, plan, rank, None)


def expected_shards(tp: TPModule, full: dict) -> dict:
    place = placements_by_fqn(tp.plan)
    return {k: take_shard(v, place.get(k), tp.plan.specs, tp.rank) for k, v in full.items()}


def assert_shards_equal(tp: TPModule, full: dict) -> None:
    want = expected_shards(tp, full)
    got = tp.state_dict()
    assert sorted(got) == sorted(want)
    for k in got:
        assert torch.equal(got[k], want[k]), k


@pytest.fixture(scope="module")
def eager():
    return models.build("llama", seed=5, **CFG)


@pytest.fixture(scope="module")
def buffers():
    return tpcompile.buffers_of(lambda: models.build("llama", **CFG))


def test_meta_capture_bakes_meta_devices_and_to_empty_retargets_them(buffers):
    _, tp = one_rank(4, 3)
    assert torch.device("meta") in baked_devices(tp.graph_module)
    tpcompile.to_empty(tp, "cpu", buffers)
    assert baked_devices(tp.graph_module) == {torch.device("cpu")}
    assert all(t.device.type == "cpu" for t in tp.state_dict().values())
    assert torch.equal(tp.graph_module.rope_cos, buffers["rope_cos"])  # the graph reads it


def test_device_constants_in_nested_graphs_are_retargeted_too():
    """torch 2.11's export puts ``no_grad`` / autocast scopes in nested graphs (the bodies of
    higher-order ops, submodules of the graph): their factory calls were left on meta."""
    body = fx.Graph()
    x = body.placeholder("x")
    ones = body.call_function(torch.ops.aten.full.default, ([2], 1.0),
                              {"device": torch.device("meta")})
    body.output(body.call_function(torch.ops.aten.add.Tensor, (x, ones)))
    root = torch.nn.Module()
    root.body = fx.GraphModule(torch.nn.Module(), body)
    outer = fx.Graph()
    outer.output(outer.call_module("body", (outer.placeholder("y"),)))
    gm = fx.GraphModule(root, outer)
    assert baked_devices(gm) == {torch.device("meta")}
    assert retarget_device_pass(gm, torch.device("cpu")).modified
    assert baked_devices(gm) == {torch.device("cpu")}
    assert torch.equal(gm(torch.zeros(2)), torch.ones(2))


def test_load_full_state_dict_copies_exactly_this_ranks_slices(eager, buffers):
    _, tp = one_rank(4, 3)
    assert tpcompile.load_full_state_dict(tp, eager.state_dict(), buffers=buffers) == ([], [])
    assert_shards_equal(tp, eager.state_dict())


def test_load_state_dict_names_a_full_state_dict_and_round_trips_shards(eager):
    _, tp = one_rank(2, 1, meta=False)
    with pytest.raises(tpcompile.TPCompileError, match=(
            r"load_state_dict got the unsharded layers.0.attention.wq.weight \(\[64, 64\]; this "
            r"rank's shard is \[32, 64\]\), 14 such tensor\(s\) in all\n  hint: load a full "
            r"state dict with tpcompile.load_full_state_dict")):
        tp.load_state_dict(eager.state_dict())
    shards = expected_shards(tp, eager.state_dict())
    assert tp.load_state_dict(shards) == ([], [])  # this rank's own shards load as in torch
    assert_shards_equal(tp, eager.state_dict())


def test_safetensors_reads_the_same_slices(tmp_path, eager, buffers):
    from safetensors.torch import save_file

    save_file(eager.state_dict(), tmp_path / "model.safetensors")
    _, tp = one_rank(2, 1)
    tpcompile.load_full_state_dict(tp, tmp_path / "model.safetensors", buffers=buffers)
    assert_shards_equal(tp, eager.state_dict())
    _, tp = one_rank(2, 0)
    tpcompile.load_full_state_dict(tp, tmp_path, buffers=buffers)  # a directory of files
    assert_shards_equal(tp, eager.state_dict())


def test_init_shards_reproduces_the_eager_seeded_model(eager, buffers):
    model, tp = one_rank(4, 2)
    torch.manual_seed(5)
    tpcompile.init_shards(tp, model, buffers=buffers)
    assert_shards_equal(tp, eager.state_dict())


def test_tied_weights_stay_tied_through_allocation():
    model, tp = one_rank(2, 0, name="gpt2")
    tpcompile.init_shards(tp, model, buffers=tpcompile.buffers_of(lambda: models.build("gpt2", **CFG)))
    assert tp.get_parameter("wte.weight") is tp.get_parameter("lm_head.weight")


def test_missing_non_persistent_buffers_are_named(eager):
    _, tp = one_rank(2, 0)
    with pytest.raises(tpcompile.TPCompileError, match=r"rope_(cos|sin).*buffers_of"):
        tpcompile.load_full_state_dict(tp, eager.state_dict())


def test_bad_sources_are_named(eager, buffers):
    _, tp = one_rank(2, 0)
    sd = dict(eager.state_dict())
    sd["output.weight"] = sd["output.weight"][:, :10]
    with pytest.raises(tpcompile.TPCompileError, match="size mismatch for output.weight"):
        tpcompile.load_full_state_dict(tp, sd, buffers=buffers)
    sd = dict(eager.state_dict(), extra=torch.zeros(1))
    del sd["norm.weight"]
    with pytest.raises(tpcompile.TPCompileError, match=r"missing keys \['norm.weight'\].*\['extra'\]"):
        tpcompile.load_full_state_dict(tp, sd)
    assert tpcompile.load_full_state_dict(tp, sd, strict=False) == (["norm.weight"], ["extra"])
    with pytest.raises(tpcompile.TPCompileError, match="a state dict or a safetensors path"):
        tpcompile.load_full_state_dict(tp, [1, 2])


def test_uninitialised_parameters_are_named():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8))
            self.cfg = models.ModelConfig(dim=8)

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        model = Scale()
    gm, plan, _ = rewrite(model, (torch.zeros(2, 8, device="meta"),), 2, 0)
    with pytest.raises(tpcompile.TPCompileError, match=r"no module initialiser covers \['w'\]"):
        tpcompile.init_shards(TPModule(gm, plan, 0, None), model)


def test_module_conversions_reach_the_graphs_own_tensors():
    _, tp = one_rank(2, 0, meta=False)
    tp.to(torch.float64)
    assert tp.graph_module.rope_cos.dtype == torch.float64
    assert "rope_cos" not in tp.state_dict()  # non-persistent stays non-persistent


def test_sharded_param_describes_chunks_and_refuses_math(eager, buffers):
    _, tp = one_rank(4, 3)
    tpcompile.load_full_state_dict(tp, eager.state_dict(), buffers=buffers)
    sd = sharded_state_dict(tp)
    wq = sd["layers.0.attention.wq.weight"]
    assert isinstance(wq, ShardedParam) and wq.shape == (64, 64) and wq.source.shape == (16, 64)
    assert [c.offsets[0] for c in wq.__create_chunk_list__()] == [48]
    wk = sd["layers.0.attention.wk.weight"]  # 2 KV heads at 4 ranks: held by all, rank 0 writes
    assert [c.sizes[0] for c in wk.__create_chunk_list__()] == [16]
    assert wk.__create_write_items__("wk", wk) == []
    assert not isinstance(sd["norm.weight"], ShardedParam)
    with pytest.raises(tpcompile.TPCompileError, match="only describes a shard"):
        wq + 1


def test_checkpoint_refuses_a_model_whose_names_collide_with_the_optimizer(tmp_path):
    from tpcompile.state import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.optimizer = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.optimizer(x)

    gm, plan, _ = rewrite(Net(), (torch.randn(2, 4),), 1, 0)
    tp = TPModule(gm, plan, 0, None)
    with pytest.raises(tpcompile.TPCompileError, match="collide with the optimizer"):
        checkpoint.save(tp, tmp_path, optimizer=torch.optim.SGD(tp.parameters(), lr=0.1))
