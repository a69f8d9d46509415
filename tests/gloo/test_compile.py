"""torch.compile on real gloo ranks: a compiled TPModule (path 1) and backend="tpcompile" (path 2).

One spawn per world size runs every check (``workers.compiled``): a graph costs seconds to
compile on 2 cores, so the models have one layer of width 32 and each graph compiles once. Path
1 compiles the static graphs first; the backend later compiles the same graphs with the same
options and gets them from inductor's FX graph cache (a fresh one per test run). CI compiles
Llama at 2 ranks (the dynamic, overlap and repeated-block checks too); the MLP and
GPT-2, and every model at 4 ranks, compile in launches of their own with ``-m slow``.
Tolerances as in test_numerics: outputs and gradients 1e-5 relative, parameters after 3 AdamW
steps 1e-4.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from support import LaunchedOnDemand, launch

pytestmark = [pytest.mark.dist, pytest.mark.compile]

MODELS = ("mlp", "gpt2", "llama")
DYNAMIC = "llama"  # compiled a second time at world size 2 with marked dims and overlap on
BLOCKS = "llama"  # with two blocks, at world size 2 only: one compiled body for both


@contextlib.contextmanager
def _inductor_env(tmp_path_factory):
    # one cache for every launch of this module (inductor's FX graph cache serves repeats)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "inductor"),
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile worker pool per rank on 2 cores
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


# a graph compiles in tens of seconds on 2 cores: CI compiles one model at 2 ranks
IN_CI = ("llama",)
WS_PARAMS = [2, pytest.param(4, marks=pytest.mark.slow)]


def _in_ci(ws: int, name: str) -> bool:
    return ws == 2 and name in IN_CI


WS_MODEL_PARAMS = [pytest.param(ws, name, marks=() if _in_ci(ws, name) else pytest.mark.slow)
                   for ws in (2, 4) for name in MODELS]


def _launch_of(ws: int, name: str) -> tuple:
    """The launch that compiles ``name`` at ``ws`` ranks: CI's, or the slow rest's."""
    return ws, tuple(m for m in MODELS if _in_ci(ws, m) == _in_ci(ws, name))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def run(key):
        ws, names = key
        with _inductor_env(tmp_path_factory):
            return launch("compiled", ws, list(names), DYNAMIC if DYNAMIC in names and ws == 2 else None)
    return LaunchedOnDemand(run)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """Launches of their own (their own timeout): a two-block model compiled by path 1 (CI),
    and by the backend (-m slow)."""
    def run(path):
        with _inductor_env(tmp_path_factory):
            return launch("compiled_blocks", 2, BLOCKS, [path])
    return LaunchedOnDemand(run)


def _case(per_rank, key):
    cases = [r[key] for r in per_rank]
    for c in cases:
        assert "error" not in c, c["error"]
    return cases


def _assert_matches_unsharded(c):
    assert c["output_err"] <= 1e-5
    worst = max(c["grad_errs"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-5, worst
    worst = max(c["step_errs"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-4, worst


@pytest.mark.parametrize("ws, name", WS_MODEL_PARAMS)
@pytest.mark.parametrize("path", ["tp", "backend"])
def test_compiled_matches_unsharded_with_training(results, ws, name, path):
    """Outputs, every gradient, and 3 AdamW steps (through the backend: after its first call)."""
    for c in _case(results[_launch_of(ws, name)], f"{path}_{name}"):
        _assert_matches_unsharded(c)


@pytest.mark.parametrize("ws, name", WS_MODEL_PARAMS)
@pytest.mark.parametrize("path", ["tp", "backend"])
def test_generated_code_issues_exactly_the_planned_collectives(results, ws, name, path):
    """One forward and one backward module; each plan collective is one _c10d_functional call."""
    for c in _case(results[_launch_of(ws, name)], f"{path}_{name}"):
        assert c["n_codes"] == 2
        assert c["compiled_block_bodies"] == [{}, {}]  # one block: nothing shared, the graph flat
        assert c["forward"] == c["planned"]["forward"]
        assert c["backward"] == c["planned"]["backward"]
        assert c["forward"]  # the plan does communicate


@pytest.mark.parametrize("ws, name", WS_MODEL_PARAMS)
def test_repeated_calls_do_not_recompile(results, ws, name):
    for c in _case(results[_launch_of(ws, name)], f"tp_{name}"):
        err, graphs = c["calls"][(2, 8)]
        assert graphs == 0 and err <= 1e-5


def test_marked_dynamic_dims_reuse_one_graph_for_other_batch_and_sequence_sizes(results):
    for c in _case(results[_launch_of(2, DYNAMIC)], "tp_dynamic"):
        _assert_matches_unsharded(c)
        for (batch, seq), (err, graphs) in c["calls"].items():
            assert err <= 1e-5, (batch, seq)
            # Dynamo specialises a size of 1: one more graph, the first time only
            assert graphs == (1 if (batch, seq) == (1, 8) else 0), (batch, seq)


def test_overlap_sinks_the_backward_wait_past_weight_gradient_matmuls(results):
    """Same model and world size: with the reorder passes a backward all-reduce stays in flight
    while weight-gradient matmuls run; without them every wait follows its collective."""
    per_rank = results[_launch_of(2, DYNAMIC)]
    for on, off in zip(_case(per_rank, "tp_dynamic"), _case(per_rank, f"tp_{DYNAMIC}")):
        assert max(on["in_flight"]) >= 1, on["in_flight"]
        assert set(off["in_flight"]) == {0}, off["in_flight"]


@pytest.mark.parametrize("ws, name", WS_MODEL_PARAMS)
def test_backend_first_call_is_exact_and_leaves_only_shards(results, ws, name):
    for c in _case(results[_launch_of(ws, name)], f"backend_{name}"):
        assert max(c["first_errs"].values()) <= 1e-5, c["first_errs"]
        assert c["param_bytes"] == c["planned_bytes"] < c["full_bytes"]
        assert c["originals_alive"] == 0  # the full tensors were released
        assert c["graphs"] == 2  # the first graph, then the tensor-parallel forward
        assert any("tensor-parallel" in r for r in c["report"]), c["report"]
        assert "build the optimizer after that call" in c["stale_optimizer"]


@pytest.mark.parametrize("path", ["tp", pytest.param("backend", marks=pytest.mark.slow)])
def test_repeated_blocks_run_one_compiled_body_with_the_planned_collectives(blocks, path):
    """Two identical blocks: the forward and the backward module each define one compiled block body
    and call it twice; its collectives, counted per call, are the plan's; numerics as flat."""
    for c in _case(blocks[path], path):
        _assert_matches_unsharded(c)
        assert c["n_codes"] == 2
        assert [list(bodies.values()) for bodies in c["compiled_block_bodies"]] == [[2], [2]]
        assert c["forward"] == c["planned"]["forward"]
        assert c["backward"] == c["planned"]["backward"]
        if path == "tp":
            assert c["compiled_block_calls"] == 2
            err, graphs = c["calls"][(2, 8)]
            assert graphs == 0 and err <= 1e-5
        else:
            assert c["graphs"] == 2


@pytest.mark.parametrize("ws", WS_PARAMS)
def test_graph_break_keeps_the_split_chain_replicated_and_says_why(results, ws):
    for c in _case(results[_launch_of(ws, IN_CI[0])], "graph_break"):
        assert max(c["errs"].values()) <= 1e-5, c["errs"]
        assert c["shapes_kept"] and not c["parallelized"]
        (report,) = c["report"]
        assert "Branchy: replicated: Dynamo split Branchy.forward at workers.py" in report
        assert "if h.sum() > 0" in report
