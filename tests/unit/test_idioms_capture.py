"""The idiom corpus (zoo/idioms) runs, is deterministic, and names each parameter's style once.

Its capture and plan (every parameter planned, at the bound, on every rank) are asserted in
tests/gloo/test_idioms.py, and its outputs and gradients at the example's sizes and others on
gloo ranks there too; bench/idioms.py measures the whole corpus (bench/results/idioms.md).
"""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from zoo import idioms

NAMES = list(idioms.IDIOMS)


def test_corpus_has_at_least_18_idioms():
    assert len(NAMES) >= 18 and len(set(NAMES)) == len(NAMES)


def test_docs_support_table_has_a_row_per_idiom():
    """docs/models.md's idiom table is written by bench/idioms.py: a new idiom needs a rerun."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    table = text[text.index("<!-- idiom-table:start -->"):text.index("<!-- idiom-table:end -->")]
    rows = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert rows == NAMES, "rerun `python -m bench.idioms --numerics` to regenerate the table"
    assert set(idioms.STYLES) == set(NAMES)


def test_the_readme_counts_the_corpus_the_results_file_measured():
    """The README's idiom counts are the corpus's and its last whole run's (the results file):
    a new idiom needs the run and the sentence updated."""
    root = Path(__file__).resolve().parents[2]
    readme = " ".join((root / "README.md").read_text().split())
    measured = (root / "bench" / "results" / "idioms.md").read_text()
    found = re.search(r"^(\d+) of (\d+) rows are the Megatron plan", measured, re.M)
    ok, rows = map(int, found.groups())
    assert rows == 2 * len(NAMES), "rerun `python -m bench.idioms --numerics`"
    assert f"in {ok} of the {rows} (idiom, ranks) rows" in readme
    assert f"{ok} of {rows} rows of its {len(NAMES)}" in readme


def _output_shape(name: str, inputs: tuple) -> tuple:
    """Logits over the vocabulary per token; a DiT's prediction has its latents' shape."""
    tokens = not inputs[0].is_floating_point()
    return (*inputs[0].shape, idioms.VOCAB) if tokens else tuple(inputs[0].shape)


@pytest.mark.parametrize("name", NAMES)
def test_runs_forward_and_backward_unsharded(name):
    model = idioms.build(name)
    inputs = idioms.example_inputs(name=name)
    logits = model(*inputs)
    assert logits.shape == _output_shape(name, inputs) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    for fqn, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), fqn
        assert p.grad.abs().sum() > 0, f"{fqn} gets no gradient (an expert no token reaches?)"


@pytest.mark.parametrize("name", NAMES)
def test_build_is_deterministic(name):
    a, b = idioms.build(name), idioms.build(name)
    for (fqn, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), fqn
    inputs = idioms.example_inputs(name=name)
    outputs = []
    for model in (a, b):  # the same random draws for both (AuraFlow's dropout)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            outputs.append(model(*inputs))
    assert torch.equal(*outputs)


@pytest.mark.parametrize("name", NAMES)
def test_expect_names_every_parameter_once(name):
    """Each trainable FQN matches exactly one of colwise / rowwise / replicated / expert, at any
    size."""
    model = idioms.build(name)
    for ws in (1, 2, 4, 8):
        expect = idioms.EXPECT[name].at(ws)
        for fqn, _ in model.named_parameters():
            hits = [s for s, globs in (("col", expect.colwise), ("row", expect.rowwise),
                                       ("rep", expect.replicated), ("expert", expect.expert))
                    if any(fnmatch(fqn, g) for g in globs)]
            assert len(hits) == 1, (ws, fqn, hits)
        globs = expect.colwise + expect.rowwise + expect.replicated + expect.expert
        for g in globs:  # no stale glob
            assert any(fnmatch(fqn, g) for fqn, _ in model.named_parameters()), g
