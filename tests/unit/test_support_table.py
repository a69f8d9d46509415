"""The README's support table is computed, not written: this test rebuilds it and compares.

Each row is one model family planned by :func:`tpcompile.explain` at 2 and 4 ranks; the counts
are read from rank 0's rewritten graph (equal to ``count_collectives`` of the module
``parallelize`` returns, tested in test_report.py). The numerics of every row are tested on real
gloo ranks in the file the last column names. After a planner change that moves a count, run

    TPCOMPILE_UPDATE_README=1 python -m pytest tests/unit/test_support_table.py

and commit the README with the new table (the diff shows what changed).
"""

from __future__ import annotations

import functools
import os
import re
from collections import Counter
from pathlib import Path

import pytest

import tpcompile
from tpcompile.tools import models
from zoo import lora_models
from zoo.hf_models import hf_inputs, hf_model


README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- support-table:start -->", "<!-- support-table:end -->"
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
TOLERANCE = 1.005  # uneven shards: a rank may hold a row more than 1/N


def _builtin(name):
    def build():
        model = models.build(name)
        return model, models.example_inputs(model), {}
    return build


def _hf(name, labels=False):
    def build():
        pytest.importorskip("transformers")
        model = hf_model(name).eval()
        ids, kwargs = hf_inputs(model)
        if labels:
            kwargs["labels"] = ids
        return model, (ids,), kwargs
    build.case = (name, labels)  # the case tests/gloo/test_hf_models.py runs
    return build


def _lora(name):
    """A LoRA (or frozen) case of tests/gloo/test_lora.py: peft on the tiny HF Llama."""
    def build():
        pytest.importorskip("peft")
        if name == "frozen":
            model = lora_models.hf_llama().requires_grad_(False)
            return (model, *lora_models.hf_inputs(model))
        return lora_models.build(name)[:3]
    build.case = name
    return build


SP, VOCAB = {"sequence_parallel": True}, {"vocab_parallel": True, "loss_parallel": True}
ROWS = [  # family, build, options, where its outputs and gradients are tested on gloo ranks
    ("MLP: Linear-GELU-Linear blocks", _builtin("mlp"), {}, "test_numerics"),
    ("GPT-2 (built-in): fused qkv, tied embeddings", _builtin("gpt2"), {}, "test_numerics"),
    ("GPT-2 (built-in)", _builtin("gpt2"), SP, "test_sequence_parallel"),
    ("Llama (built-in): GQA 8/2, RoPE, SwiGLU", _builtin("llama"), {}, "test_numerics"),
    ("Llama (built-in)", _builtin("llama"), SP, "test_sequence_parallel"),
    ("HF LlamaForCausalLM: GQA 8/2", _hf("llama"), {}, "test_hf_models"),
    ("HF LlamaForCausalLM with labels", _hf("llama", labels=True), VOCAB, "test_hf_models"),
    ("HF LlamaForCausalLM: multi-query 8/1", _hf("llama_mqa"), {}, "test_hf_models"),
    ("HF GPT2LMHeadModel: Conv1D, fused c_attn", _hf("gpt2"), {}, "test_hf_models"),
    ("HF BertForMaskedLM: encoder, padding mask", _hf("bert"), {}, "test_hf_models"),
    ("HF LlamaForCausalLM, frozen: `requires_grad_(False)`", _lora("frozen"), {}, "test_lora"),
    ("HF LlamaForCausalLM + peft LoRA on every linear", _lora("peft_all"), {}, "test_lora"),
]


def _counts(entries) -> str:
    """'2 AR' / '2 AG + 2 RS' for one phase's collectives; '-' for none."""
    c = Counter(SHORT[e.op] for e in entries)
    return " + ".join(f"{n} {op}" for op, n in sorted(c.items())) or "-"


def _phases(entries) -> str:
    return " / ".join(_counts([e for e in entries if e.phase == p]) for p in ("forward", "backward"))


def _cells(report) -> tuple[str, str, str]:
    """(chains of the first layer, its collectives, collectives outside layers)."""
    by_layer: dict[str, list] = {}
    for c in report.collectives:
        by_layer.setdefault(c.layer, []).append(c)
    layers = [row.layer for row in report.megatron if row.layer]
    first = layers[0]
    per_layer = {_phases(by_layer.get(layer, [])) for layer in layers}
    assert len(per_layer) == 1, f"layers differ: {per_layer}"  # 'per layer' must mean it
    chains = "; ".join(c["summary"] for c in report.chains.values() if c["layer"] == first)
    return chains, per_layer.pop(), _phases(by_layer.get("", []))


def _options(options: dict) -> str:
    return ", ".join(k.removesuffix("_parallel") for k in options) or "-"


@functools.cache
def _reports() -> tuple:
    """Per row of ROWS, its ``explain`` reports at 2 and 4 ranks."""
    out = []
    for _, build, options, _ in ROWS:
        model, inputs, kwargs = build()
        out.append(tuple(tpcompile.explain(model, inputs, ws, example_kwargs=kwargs, **options)
                         for ws in (2, 4)))
    return tuple(out)


def render() -> str:
    lines = ["| model | options | sharded per layer (ranks 2) | per layer fwd / bwd, 2 ranks "
             "| per layer fwd / bwd, 4 ranks | outside layers, 4 ranks | numerics |",
             "|---|---|---|---|---|---|---|"]
    for (family, _, options, test), (two, four) in zip(ROWS, _reports()):
        chains, layer2, _ = _cells(two)
        _, layer4, outside4 = _cells(four)
        lines.append(f"| {family} | {_options(options)} | {chains} | {layer2} | {layer4} "
                     f"| {outside4} | `tests/gloo/{test}.py` |")
    return "\n".join(lines)


def test_readme_support_table_is_the_measured_one():
    table = render()
    text = README.read_text()
    block = re.compile(re.escape(START) + r"\n(?:.*?\n)?" + re.escape(END), re.S)
    assert block.search(text), f"README.md has no {START} ... {END} block"
    if os.environ.get("TPCOMPILE_UPDATE_README"):
        README.write_text(block.sub(lambda _: f"{START}\n{table}\n{END}", text))
        text = README.read_text()
    assert f"{START}\n{table}\n{END}" in text, (
        f"the README's support table is stale; the measured one is:\n{table}\n"
        "rerun with TPCOMPILE_UPDATE_README=1 to write it")


@pytest.mark.parametrize("row", [pytest.param(i, id=r[0]) for i, r in enumerate(ROWS)])
def test_every_layer_is_at_megatrons_bound(row):
    """No row keeps whole a weight Megatron's plan splits (the bound derived from the model,
    tpcompile.inspect.bound.bound) or holds more parameter bytes per rank than that plan, and none
    pays more all-reduces per layer than it, at 2 and 4 ranks. Sequence-parallel rows trade
    each all-reduce for a gather and a reduce-scatter: their counts are the table's."""
    for report in _reports()[row]:
        assert max(report.param_bytes_per_rank) <= report.param_bytes_ideal * TOLERANCE, (
            report.world_size, report.param_bytes_per_rank, report.param_bytes_ideal)
        for m in report.megatron:
            assert not m.whole, (report.world_size, m.whole)
            if m.layer and "sequence_parallel" not in ROWS[row][2]:
                assert not m.above(), (report.world_size, m)


def test_every_row_runs_at_2_and_4_ranks_in_ci():
    """The README says each row's outputs and gradients are compared on 2- and 4-rank groups
    in the named file: for Hugging Face rows, CI's 4-rank set must hold the row's case."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from gloo import test_hf_models, test_lora
    in_ci = {"test_hf_models": lambda case: case in test_hf_models.AT_4_IN_CI,
             "test_lora": lambda case: all(case in test_lora.IN_CI[ws] for ws in (2, 4))}
    for family, build, _, test in ROWS:
        if test in in_ci:
            assert in_ci[test](build.case), family
