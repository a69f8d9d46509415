"""Checkpoints, loading and training on real gloo ranks (bodies in ``state_workers.py``).

Two spawns serve every test here: 4 ranks (peak memory, DCP resharding 2 <-> 4 with ranks 0-1
as the 2-rank group, gathering, clipping) and 2 ranks (local state dicts, meta-device builds,
20 training steps). Parameter values are compared bitwise (``torch.equal``); numerics against
the unsharded model use the suite's float32 tolerance, 1e-5 relative.
"""

from __future__ import annotations

import os

from pathlib import Path

import pytest

from tpcompile.tools import models
from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

BODIES = str(Path(__file__).parent / "state_workers.py")
BIG = {"dim": 1024, "hidden": 4096, "n_layers": 4}  # 128 MiB of fp32 weights; 32 MiB per rank at 4
MiB = 2**20


def _launch(function: str, world_size: int, *args, fresh_interpreter=False) -> list:
    return run_on_ranks(f"{BODIES}:{function}", world_size, *args, timeout=300,
                        fresh_interpreter=fresh_interpreter)


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("error")
    return result


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("state4")
    big = str(tmp / "big_mlp.safetensors")
    save_file(models.build("mlp", **BIG).state_dict(), big)
    # a fixed mmap threshold: glibc otherwise raises it after the first large free and keeps
    # later freed tensors in the heap, so the peak RSS would count a freed module or not by luck
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    try:
        # read when a process starts: a forked rank would keep its server's malloc settings
        return _launch("memory_and_checkpoints", 4, str(tmp), big, BIG, fresh_interpreter=True)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch("state_and_training", 2, str(tmp_path_factory.mktemp("state2")))


# ---------------------------------------------------------------------------- checkpoints
def test_full_state_dict_is_the_models_state_dict(four):
    for r in four[:2]:
        for name, c in _ok(r["save_ws2"]).items():
            assert c["gathered_vs_model"] == [], name


def test_dcp_checkpoint_reshards_2_to_4_bitwise(four):
    """gpt2 (fused qkv, tied), llama (2 KV heads: replicated at 4), fused GQA (several ranges
    per rank, some held by every rank)."""
    for r in four:
        for name, c in _ok(r["reshard_2_to_4"]).items():
            assert c["loaded_2_to_4"] == [], name
            assert c["changed_by_step"], name  # the 4-rank checkpoint holds new values


def test_dcp_checkpoint_reshards_4_to_2_bitwise(four):
    for r in four[:2]:
        for name, c in _ok(r["reshard_4_to_2"]).items():
            assert c["loaded_4_to_2"] == [], name


def test_tp_checkpoint_loads_into_the_unsharded_model(four):
    for r in four:
        for name, c in _ok(r["reshard_2_to_4"]).items():
            assert c["unsharded_dcp_load"] == [], name
    keys = _ok(four[0]["plain"])["torch_save_keys"]  # dcp_to_torch_save of a 4-rank checkpoint
    assert keys == sorted(models.build("llama").state_dict())


def test_unsharded_checkpoint_loads_into_shards(four):
    for r in four:
        assert _ok(r["plain"])["plain_into_tp"] == []


RESUMED_PARAM_TOLERANCE = 1e-3


def test_training_resumes_at_another_world_size_with_optimizer_state(four):
    """3 AdamW steps at 2 ranks, checkpoint (model + optimizer), 2 more steps at 4 ranks ==
    5 steps of the unsharded model. Parameters: 1e-3 relative (measured 1.1e-4: Adam turns
    rounding noise in near-zero gradients into lr-sized steps, see check.compare); resuming
    with a fresh optimizer instead misses by 3e-2 and changes the loss of step 5."""
    for r in four[:2]:
        assert len(_ok(r["resume_save"])["losses"]) == 3
    for r in four:
        c = _ok(r["resume"])
        for a, b in zip(c["losses"], c["want"]):
            assert abs(a - b) <= 1e-4, (a, b)
        assert c["param_err"] <= RESUMED_PARAM_TOLERANCE
        assert c["param_err_fresh_optimizer"] >= 10 * RESUMED_PARAM_TOLERANCE
        assert abs(c["losses_fresh_optimizer"][1] - c["want"][1]) > 1e-2


def test_gather_to_one_rank(four):
    for rank, r in enumerate(four):
        for name, c in r["reshard_2_to_4"].items():
            assert c["gather_to_rank0"] == [], (rank, name)  # rank 0: equal; others: empty


# ---------------------------------------------------------------------------- memory
def test_meta_build_peak_memory_stays_near_the_shard(four):
    """Peak RSS growth of build (meta) + parallelize + fill, per rank, at 4 ranks.

    Bound: this rank's shards + one full tensor (a safetensors slice along dim 1 maps most of
    its tensor's pages; an initialiser runs on one whole module) + 24 MiB for the interpreter
    and allocator. For this model that is about half the full model; building it eagerly
    measures the full size (the control shows the measurement sees allocations).
    """
    for r in four:
        m = _ok(r["memory"])
        bound = m["local_bytes"] + m["largest_full_tensor"] + 24 * MiB
        assert m["full_bytes"] >= 3.9 * m["local_bytes"]
        assert m["eager_delta"] >= 0.9 * m["full_bytes"], m
        assert m["file_delta"] <= bound, m
        assert m["init_delta"] <= bound, m
        assert bound < 0.6 * m["full_bytes"]


# ---------------------------------------------------------------------------- clipping
def test_clip_grad_norm_uses_the_global_norm(four):
    """At 4 ranks, where layouts overlap (2 KV heads) and are multi-range (fused GQA); the 2-rank
    case is checked step by step in the training test."""
    for r in four:
        for name, c in _ok(r["clip"]).items():
            assert c["clipping"], name  # max_norm is below the norm: clipping is active
            assert c["norm"] <= 1e-5 and c["inf"] <= 1e-5, (name, c)
            assert c["grads"] <= 1e-5, (name, c)


# ---------------------------------------------------------------------------- 2 ranks
def test_local_state_dict_round_trips(two):
    for r in two:
        for name, c in r["round_trip"].items():
            c = _ok(c)
            assert c["keys_are_models"] and c["differed_before"], name
            assert c["after_load"] == [], name


def test_meta_build_from_safetensors_and_initialisers_matches_eager(two):
    for r in two:
        m = _ok(r["meta"])
        assert m["meta_devices_before"] == ["meta"]
        assert "buffers_of" in m["missing_buffers_error"]
        for route in ("file", "init"):
            assert m[route]["output_err"] <= 1e-5, route
            assert max(m[route]["grad_errs"].values()) <= 1e-5, route
        assert m["init_equals_eager_seed"] == []


def test_twenty_adamw_steps_match_the_unsharded_run(two):
    for r in two:
        t = _ok(r["training"])
        ref, tp = t["ref"], t["tp"]
        assert ref["losses"][-1] < 0.2 * ref["losses"][0]  # it trains
        assert sum(n > 1.0 for n in ref["norms"]) >= 5  # and clipping is active
        assert abs(tp["norms"][0] - ref["norms"][0]) <= 1e-5 * ref["norms"][0]  # global norm
        for a, b in zip(tp["norms"], ref["norms"]):
            assert abs(a - b) <= 1e-4 * b
        for step, (a, b) in enumerate(zip(tp["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-4, (step, a, b)


BF16_TOLERANCE = 1e-2  # measured: at most 1.6e-3 from the fp32 run over the 20 steps


def test_bf16_autocast_trains_within_tolerance(two):
    for r in two:
        t = _ok(r["training"])
        for step, (a, b) in enumerate(zip(t["tp_bf16"]["losses"], t["ref"]["losses"])):
            assert abs(a - b) <= BF16_TOLERANCE, (step, a, b)
