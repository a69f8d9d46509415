"""``experts="expert"`` under ``torch.compile(parallelize(model), fullgraph=True)`` on 2 gloo ranks.

Whole experts per rank, stacked (zoo's ``StackedMoE``: ``bmm`` over the rank's experts) and
transformers' grouped matmul (tiny Mixtral: each rank multiplies the rows routed to its experts,
their bounds read from the offsets at run time, sizes Dynamo and inductor cannot know ahead).
Compiled as one graph, the output and every gradient equal the unsharded float32 model's
(1e-5, as tests/gloo/test_compile.py). CI compiles Mixtral with ``aot_eager`` (Dynamo and
AOTAutograd: the functional collectives and the data-dependent row bounds traced, forward and
backward); the stacked model, and both under inductor (over a minute per model on 2 cores),
are ``-m slow``: ``pytest -m slow tests/gloo/test_compile_experts.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import tpcompile
from tpcompile.tools.launch import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.compile]

TOLERANCE = 1e-5
MODELS = ("stacked", "mixtral")


def _model(name: str):
    """(model, positional inputs, keyword inputs) of ``name``."""
    import torch

    from zoo.hf_models import hf_inputs, hf_model
    from zoo.idioms import LM, StackedMoE, example_inputs

    torch.manual_seed(0)
    if name == "stacked":
        return LM(mlp=StackedMoE), example_inputs(), {}
    model = hf_model("mixtral")
    ids, kwargs = hf_inputs(model)
    return model, (ids,), kwargs


def _compiled_rank(rank: int, world_size: int, backend: str, names: list[str]) -> dict:
    """On each rank: model -> (output error, largest gradient error, experts lines) compiled
    whole (``fullgraph``) with ``backend``."""
    import torch

    from tpcompile.tools.numerics import compare

    out = {}
    for name in names:
        model, inputs, kwargs = _model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs, experts="expert")
            c = compare(model, torch.compile(tp, backend=backend, fullgraph=True), inputs,
                        kwargs=kwargs)
        out[name] = (c.output_err, c.max_grad_err, sorted(set(tp.plan.experts.values())))
    return out


@pytest.mark.parametrize("backend,names", [
    ("aot_eager", ["mixtral"]),
    pytest.param("aot_eager", ["stacked"], marks=pytest.mark.slow),
    pytest.param("inductor", list(MODELS), marks=pytest.mark.slow)])
def test_compiled_whole_experts_equal_the_unsharded_model(backend, names, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no worker pool per rank
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    per_rank = run_on_ranks(f"{Path(__file__).resolve()}:_compiled_rank", 2, backend, names)
    for name in names:
        for out_err, grad_err, how in (r[name] for r in per_rank):
            assert all(h.startswith("expert parallel") for h in how), (name, how)
            assert out_err <= TOLERANCE and grad_err <= TOLERANCE, (name, out_err, grad_err)
