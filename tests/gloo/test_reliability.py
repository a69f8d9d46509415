"""No silent wrong answers: random models, the bad-input catalogue and parallelize's contracts,
on real gloo ranks (one spawn per world size).

Random models are drawn by hypothesis in this process from a fixed seed (the same specs on
every run), sent to the ranks as plain data and rebuilt there; specs that once found a bug
(``tests/corpus``) are replayed alongside. They run in float64: random stacks can be badly
conditioned (a norm over 1 feature, a 2-token softmax), where float32 rounding alone exceeds
1e-5, while float64 keeps rounding near 1e-13 and every bug found so far was 1e-1 or worse.
The catalogue models run in float32 at the suite's usual 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.tools.launch import run_on_ranks
from zoo import catalogue_models, random_models

pytestmark = pytest.mark.dist

WORKERS = str(Path(__file__).parent / "reliability_workers.py")
SEED, EXAMPLES = 2025, 8
WORLD_SIZES = (2, 3, 4)
CATALOGUE_AT = (2, 4)
F64_TOL, F32_TOL = 1e-9, 1e-5


def _cases() -> list[tuple[str, int, dict]]:
    """(label, world size, spec): the drawn specs over world sizes 2-4, then the corpus."""
    drawn = random_models.draw(EXAMPLES, SEED)
    cases = [(f"drawn{i}", WORLD_SIZES[i % 3], dict(s, dtype="float64")) for i, s in enumerate(drawn)]
    return cases + [(name, c["world_size"], c["spec"]) for name, c in random_models.corpus().items()]


CASES = _cases()


@pytest.fixture(scope="module")
def runs():
    out = {}
    for ws in WORLD_SIZES:
        specs = [spec for _, w, spec in CASES if w == ws]
        names = sorted(catalogue_models.NUMERIC) if ws in CATALOGUE_AT else []
        out[ws] = run_on_ranks(f"{WORKERS}:reliability", ws, specs, names, ws == 2, timeout=900)
    return out


def _spec_results(runs, label):
    _, ws, _ = next(c for c in CASES if c[0] == label)
    index = [lab for lab, w, _ in CASES if w == ws].index(label)
    return [rank["specs"][index] for rank in runs[ws]]


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_random_model_matches_or_is_refused_by_name(runs, label):
    for r in _spec_results(runs, label):
        assert "crash" not in r, r["crash"]
        if "refused" in r:  # allowed: a TPCompileError subclass that says why, not a wrapped bug
            assert r["refused"].split(":")[0].endswith("Error") and "internal error" not in r["refused"]
            continue
        assert r["output_err"] <= F64_TOL, r
        assert max(r["grad_errs"].values(), default=0.0) <= F64_TOL, r["grad_errs"]


def test_random_models_are_mostly_sharded_not_refused(runs):
    """Guards against a vacuous property: most drawn models must really run sharded."""
    results = [_spec_results(runs, label)[0] for label, _, _ in CASES]
    refused = [r for r in results if "refused" in r]
    sharded = [r for r in results if set(r.get("styles", ())) - {"replicate"}]
    assert len(refused) <= len(results) // 4, refused
    assert len(sharded) >= len(results) // 2


@pytest.mark.parametrize("ws", CATALOGUE_AT)
@pytest.mark.parametrize("name", sorted(catalogue_models.NUMERIC))
def test_catalogue_model_is_exact(runs, ws, name):
    for r in (rank["catalogue"][name] for rank in runs[ws]):
        assert "crash" not in r, r["crash"]
        assert r["output_err"] <= F32_TOL
        assert max(r["grad_errs"].values()) <= F32_TOL, r["grad_errs"]
        assert max(r["buffer_errs"].values(), default=0.0) <= F32_TOL, r["buffer_errs"]


def _catalogue(runs, ws, name):
    return runs[ws][0]["catalogue"][name]


@pytest.mark.parametrize("ws", CATALOGUE_AT)
def test_in_place_ops_stay_sharded(runs, ws):
    styles = _catalogue(runs, ws, "in_place_ops")["styles"]
    assert styles["fc1.weight"] == "colwise" and styles["fc2.weight"] == "rowwise"


@pytest.mark.parametrize("ws", CATALOGUE_AT)
def test_writes_into_sharded_slices_keep_the_chain_replicated(runs, ws):
    r = _catalogue(runs, ws, "slice_assign")
    assert set(r["styles"].values()) == {"replicate"}
    assert "slice" in r["reasons"]["fc1.weight"] or "fill_" in r["reasons"]["fc1.weight"]


def test_world_size_larger_than_a_dim_replicates_it(runs):
    r = _catalogue(runs, 4, "narrow")
    assert r["reasons"]["fc1.weight"] == "3 output features: fewer than the 4 ranks, nothing to split"
    assert _catalogue(runs, 2, "narrow")["styles"]["fc1.weight"] == "colwise"


@pytest.mark.parametrize("ws", CATALOGUE_AT)
def test_shared_parameters_and_complex_values_are_sharded(runs, ws):
    assert _catalogue(runs, ws, "shared_module")["styles"]["down.weight"] == "rowwise"
    assert _catalogue(runs, ws, "complex_rotary")["styles"]["fc2.weight"] == "rowwise"
    assert _catalogue(runs, ws, "int8_weight")["styles"]["w_q"] == "colwise"


def _contracts(runs):
    results = [rank["contracts"] for rank in runs[2]]
    for r in results:
        assert "crash" not in r, r["crash"]
    return results


def test_parallelize_twice_gives_the_same_module(runs):
    for r in _contracts(runs):
        assert r["twice_same_plan"] and r["twice_same_shards"]
        assert r["twice_numerics"]["output_err"] <= F32_TOL
        assert max(r["twice_numerics"]["grad_errs"].values()) <= F32_TOL
        assert r["changed_by_success"] == []


def test_parallelize_on_its_result_is_refused(runs):
    for r in _contracts(runs):
        assert "the model is already parallelized (a TPModule holding rank" in r["on_tpmodule"]


@pytest.mark.parametrize("case", ["custom_function", "python_counter"])
def test_failed_parallelize_leaves_the_model_as_it_was(runs, case):
    for r in _contracts(runs):
        assert r[case]["error"] != "no error"
        assert r[case]["changed"] == [] and r[case]["still_usable"]


def test_token_ids_outside_the_vocabulary_raise(runs):
    for r in _contracts(runs):
        assert r["vocab_style"] == "vocab"
        assert r["vocab_numerics"]["output_err"] <= F32_TOL
        assert "token ids must be in [0, 16), got values from 16 to 16" in r["id_too_large"]
        assert "token ids must be in [0, 16), got values from -16 to -1" in r["id_negative"]
