"""The chaos matrix: one rank misbehaves at call time; every other rank ends with a named error.

For both ``check_calls`` modes, at 2 and 4 gloo ranks (one spawn each, tests/gloo/
chaos_workers.py), the last rank calls with another batch, sequence length or dtype, holds a
token id beyond the table, skips a forward or a backward, or exits. Asserted for every rank:
the outcome in ``EXPECTED`` (an error class, or none), how long it took (at once, or the
process-group timeout), that no process aborted (the launcher reports a rank that died), and,
after an input error on every rank, that the next correct call equals the unsharded model.

``TPCOMPILE_CHAOS_MATRIX=path`` writes the measured matrix as the markdown table that
docs/guarantees.md quotes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import LaunchedOnDemand
from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

WORKERS = str(Path(__file__).parent / "chaos_workers.py")
TIMEOUT_S = 2.0
WORLD_SIZES = (2, 4)
MODES = ("new", "every")
FAST, TIMEOUT = "at once", "timeout"
MISMATCH, INPUT, COLLECTIVE = "InputMismatchError", "InputError", "CollectiveError"
CHECK = "CollectiveError: the call check"  # a check nobody answered, on the gloo side group

# (mode, perturbation) -> ((victim's error, when), (the others' error, when)); None: no error
EXPECTED = {
    ("new", "new_sequence"): ((MISMATCH, FAST), (MISMATCH, FAST)),  # new to every rank
    # the others' call was agreed before, so only the victim checks: its check and the
    # others' model collective wait on different groups until the timeout
    ("new", "batch"): ((CHECK, TIMEOUT), (COLLECTIVE, TIMEOUT)),
    ("new", "sequence"): ((CHECK, TIMEOUT), (COLLECTIVE, TIMEOUT)),
    ("new", "dtype"): ((CHECK, TIMEOUT), (COLLECTIVE, TIMEOUT)),
    ("new", "raise_in_forward"): ((INPUT, FAST), (COLLECTIVE, TIMEOUT)),
    ("new", "skip_forward"): ((None, None), (COLLECTIVE, TIMEOUT)),
    # the victim's next forward follows no backward: a call new to it, checked; its check and
    # the others' backward wait on different groups until the timeout
    ("new", "skip_backward"): ((CHECK, TIMEOUT), (COLLECTIVE, TIMEOUT)),
    ("new", "values"): ((MISMATCH, FAST), (MISMATCH, FAST)),  # the first call of a signature
    ("new", "later_values"): ((None, None), (None, None)),  # an agreed call: not compared
    ("every", "new_sequence"): ((MISMATCH, FAST), (MISMATCH, FAST)),
    ("every", "values"): ((MISMATCH, FAST), (MISMATCH, FAST)),
    ("every", "later_values"): ((MISMATCH, FAST), (MISMATCH, FAST)),
    ("every", "batch"): ((MISMATCH, FAST), (MISMATCH, FAST)),
    ("every", "sequence"): ((MISMATCH, FAST), (MISMATCH, FAST)),
    ("every", "dtype"): ((INPUT, FAST), (MISMATCH, FAST)),  # the victim refuses its own call
    ("every", "raise_in_forward"): ((INPUT, FAST), (MISMATCH, FAST)),
    ("every", "skip_forward"): ((None, None), (CHECK, TIMEOUT)),
    ("every", "skip_backward"): ((CHECK, TIMEOUT), (COLLECTIVE, TIMEOUT)),
}
PERTURBATIONS = list(dict.fromkeys(p for _, p in EXPECTED))


# the 4-rank matrix (same mechanisms, a ring of 4) runs with -m slow: CI time
WS_PARAMS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def runs():
    out = LaunchedOnDemand(lambda ws: run_on_ranks(f"{WORKERS}:chaos", ws, list(MODES),
                                                   PERTURBATIONS, TIMEOUT_S, timeout=600))
    if os.environ.get("TPCOMPILE_CHAOS_MATRIX"):
        Path(os.environ["TPCOMPILE_CHAOS_MATRIX"]).write_text(
            _matrix({ws: out[ws] for ws in WORLD_SIZES}))
    return out


def _assert_outcome(r: dict, expected: tuple):
    error, when = expected
    if error is None:
        assert r["error"] == "no error", r
        return
    assert r["error"].startswith(error), r["error"]
    if when == FAST:
        assert r["seconds"] < TIMEOUT_S - 0.5, r
    else:
        assert TIMEOUT_S - 0.5 <= r["seconds"] <= TIMEOUT_S + 10, r


@pytest.mark.parametrize("ws", WS_PARAMS)
@pytest.mark.parametrize("mode, perturbation", list(EXPECTED))
def test_every_rank_ends_as_documented(runs, ws, mode, perturbation):
    victim, others = EXPECTED[mode, perturbation]
    ranks = [r[mode][perturbation] for r in runs[ws]]
    for r in ranks[:-1]:
        _assert_outcome(r, others)
    _assert_outcome(ranks[-1], victim)
    if all(r["error_type"] in (MISMATCH, INPUT) for r in ranks):  # nothing half-issued
        for r in ranks:
            assert r["recovered_err"] <= 1e-5, r


def _mismatch_messages(runs, ws, perturbation):
    """Per check mode: (the one message every rank raised, how the victim's peers are named)."""
    for mode in MODES:
        messages = {r[mode][perturbation]["error"] for r in runs[ws]}
        assert len(messages) == 1  # the same text on every rank
        yield messages.pop(), "rank 0" if ws == 2 else f"ranks {list(range(ws - 1))}"


@pytest.mark.parametrize("ws", WS_PARAMS)
def test_a_mismatch_names_every_ranks_call(runs, ws):
    for m, others in _mismatch_messages(runs, ws, "new_sequence"):
        assert m.startswith("InputMismatchError: ranks called the module with different inputs")
        assert f"  {others}: " in m and "(int64[2, 16]), grad" in m
        assert f"  rank {ws - 1}: " in m and "(int64[2, 24]), grad" in m


@pytest.mark.parametrize("ws", WS_PARAMS)
def test_ranks_fed_different_batches_are_named(runs, ws):
    for m, others in _mismatch_messages(runs, ws, "values"):
        assert m.startswith("InputMismatchError: ranks called the module with the same shapes "
                            "("), m  # "(call 3: " in "every" mode
        assert ("(int64[2, 20]), grad, after a backward) but different values of input tokens "
                "(every input tensor is compared") in m, m
        assert f"\n  input tokens:\n    {others}: " in m and f"\n    rank {ws - 1}: " in m, m


@pytest.mark.parametrize("ws", WS_PARAMS)
def test_every_mode_compares_the_values_of_a_later_agreed_call(runs, ws):
    messages = {r["every"]["later_values"]["error"] for r in runs[ws]}
    assert len(messages) == 1
    m = messages.pop()
    assert m.startswith("InputMismatchError: ranks called the module with the same shapes "), m
    assert "(int64[2, 8]), grad, after a backward) but different values of input tokens " in m, m
    others = "rank 0" if ws == 2 else f"ranks {list(range(ws - 1))}"
    assert f"\n  input tokens:\n    {others}: " in m and f"\n    rank {ws - 1}: " in m, m


@pytest.mark.parametrize("ws", WS_PARAMS)
def test_ranks_fed_different_float_features_are_named(runs, ws):
    """Float inputs are compared too: on a first call ("new"), on every call ("every")."""
    others = "rank 0" if ws == 2 else f"ranks {list(range(ws - 1))}"
    for mode in MODES:
        per_rank = [r["float_values"][mode] for r in runs[ws]]
        calls = ("first", "later") if mode == "every" else ("first",)
        for call in calls:
            messages = {r[call]["error"] for r in per_rank}
            assert len(messages) == 1, messages  # the same text on every rank
            m = messages.pop()
            assert m.startswith("InputMismatchError: ranks called the module with the same "
                                "shapes ("), m
            assert "(float32[2, 8, 16]), no grad) but different values of input features " in m, m
            assert f"\n  input features:\n    {others}: " in m and f"\n    rank {ws - 1}: " in m, m
        if mode == "new":  # a later call of an agreed description is not compared
            assert all(r["later"]["error"] == "no error" for r in per_rank)
        assert all(r["after"] < 1e-6 for r in per_rank)  # the next agreed call is right


@pytest.mark.parametrize("ws", WS_PARAMS)
def test_a_rank_refusing_its_inputs_is_named_to_the_others(runs, ws):
    r = runs[ws][0]["every"]["raise_in_forward"]
    assert r["error"].startswith(
        f"InputMismatchError: rank {ws - 1} refused its inputs (InputError: input tokens: token id "
        "64 is out of range for the embedding tok_embeddings.weight (64 rows)")
    assert runs[ws][-1]["every"]["raise_in_forward"]["error"].startswith(
        "InputError: input tokens: token id 64 is out of range")


def test_a_rank_that_skips_a_collective_times_out_clearly(runs):
    """The model's own collective, without a call check ("new" mode, an agreed call)."""
    r = runs[2][0]["new"]["skip_forward"]
    assert r["error"].startswith("CollectiveError: all_reduce on process group")
    assert f"failed on rank 0 of 2: Timed out waiting {TIMEOUT_S * 1000:.0f}ms" in r["error"]
    assert "did not reach this collective" in r["error"]
    assert f"the process group's timeout ({TIMEOUT_S:g} s)" in r["error"]
    assert r["is_runtime_error"]  # also what torch raises for the same failure


@pytest.mark.parametrize("ws", WS_PARAMS)
@pytest.mark.parametrize("phase", ["exited_backward", "exited_forward"])
def test_a_rank_that_exits_makes_the_others_raise(runs, ws, phase):
    """At 2 ranks at once ("Connection closed by peer"); at 4 ranks its ring neighbours at
    once, and a rank that only waits for those neighbours at the latest at the timeout."""
    survivors = [r[phase] for r in runs[ws][:-1]]
    # a forward after the failed backward is new to the module (it follows no backward), so
    # the call check is the first collective to meet the missing rank
    first = {"exited_backward": "CollectiveError: all_reduce on process group",
             "exited_forward": "CollectiveError: the call check (an all_reduce) on process group"}
    for r in survivors:
        assert r["error"].startswith(first[phase]), r
        assert r["seconds"] <= TIMEOUT_S + 10
    at_once = [r for r in survivors if r["seconds"] < TIMEOUT_S]
    assert at_once and all("Connection closed by peer" in r["error"] for r in at_once)
    if ws == 2:
        assert survivors == at_once


def _cell(r: dict) -> str:
    if r["error"] == "no error":
        return "no error"
    kind = "call check timed out" if r["error"].startswith(CHECK) else r["error_type"]
    return f"{kind} ({r['seconds']:.1f} s)"


def _matrix(runs) -> str:
    lines = ["| mode | perturbation | " + " | ".join(
        f"{ws} ranks: victim | {ws} ranks: others" for ws in WORLD_SIZES) + " |",
        "|---|---|" + "---|---|" * len(WORLD_SIZES)]
    for mode, p in EXPECTED:
        cells = []
        for ws in WORLD_SIZES:
            ranks = [r[mode][p] for r in runs[ws]]
            others = sorted({_cell(r).split(" (")[0] for r in ranks[:-1]})
            worst = max(r["seconds"] for r in ranks[:-1])
            cells += [_cell(ranks[-1]), f"{', '.join(others)} (<= {worst:.1f} s)"]
        lines.append(f"| {mode} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
