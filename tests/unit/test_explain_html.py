"""explain's HTML page: the picture is the plan's (boxes, colours, marks), the page is whole."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.inspect.explain.plan_block import block_view
from tpcompile.inspect.trace import trace_rewrite
from tpcompile.tools import models
from tpcompile.tools.cli import main

from support import workers


class _Boxes(HTMLParser):
    """Every box of the picture: (inside the block?, data-param, data-style); every mark."""

    def __init__(self):
        super().__init__()
        self.stack, self.boxes, self.marks = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "g":
            self.stack.append(a.get("class", ""))
            if a.get("class") == "box":
                self.boxes.append(("block" in self.stack, a["data-param"], a["data-style"]))
            if a.get("class") == "collective":
                self.marks.append(("block" in self.stack, a["data-phase"], a["data-op"]))

    def handle_endtag(self, tag):
        if tag == "g":
            self.stack.pop()


def _parse(html: str) -> _Boxes:
    parser = _Boxes()
    parser.feed(html)
    assert parser.stack == []
    return parser


@pytest.fixture(scope="module")
def llama8():
    model = models.build("llama")
    return model, tpcompile.explain(model, models.example_inputs(model), 8), \
        tpcompile.explain(model, models.example_inputs(model), 8, html=True)


def test_block_is_drawn_once_with_a_box_per_weight_in_its_style(llama8):
    model, report, html = llama8
    parsed = _parse(html)
    block = {name: style for inside, name, style in parsed.boxes if inside}
    weights = [n for n, _ in model.named_parameters() if n.startswith("layers.0.")]
    assert sorted(block) == sorted(weights)  # no bias in this model: one box per parameter
    assert all(block[n] == report.params[n].style for n in block)
    assert block["layers.0.attention.wq.weight"] == "colwise"
    assert block["layers.0.attention.wo.weight"] == "rowwise"
    assert block["layers.0.attention.wk.weight"] == "replicate"  # 2 KV heads on 8 ranks
    outside = {name for inside, name, _ in parsed.boxes if not inside}
    assert outside == {"tok_embeddings.weight", "norm.weight", "output.weight"}  # no buffers
    assert not any(name.startswith("layers.1.") for _, name, _ in parsed.boxes)
    assert "drawn once for 2 identical layer(s)" in html


def test_collectives_of_the_block_are_marks_forward_and_backward(llama8):
    _, report, html = llama8
    marks = [m for m in _parse(html).marks if m[0]]
    ours = [c for c in report.collectives if c.layer == "layers.0"]
    assert sorted((c.phase, c.op) for c in ours) == sorted((p, o) for _, p, o in marks)
    assert {p for _, p, _ in marks} == {"forward", "backward"}


def test_page_has_bytes_bound_table_and_every_kept_whole_weight_with_its_line(llama8):
    _, report, html = llama8
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html and "<link" not in html
    assert "http:" not in html.replace("http://www.w3.org/2000/svg", "")
    bars = re.findall(r'<g class="bar" data-rank="(\d+)" data-bytes="(\d+)">', html)
    assert [int(b) for _, b in bars] == report.param_bytes_per_rank
    # the whole wk / wv's partial gradients ride in the input's all-reduce, bound and plan alike
    assert "at the bound" in html and "at the bound (+" not in html
    # output.weight is kept whole; wk / wv are replicated inside the attention: each with the
    # model line that reads it
    assert re.search(r"<code>output\.weight</code>.*?models\.py:\d+: return self\.output", html)
    assert re.search(r"layers\.0\.attention\.wk\.weight</code>.*?models\.py:\d+: k = self\.wk\(x\)", html)


def test_layers_that_differ_from_the_block_are_listed_not_drawn():
    model = models.build("llama", n_layers=3)
    inputs = models.example_inputs(model)
    trace = trace_rewrite(model, inputs, 2, copy_weights=False)
    report = tpcompile.explain(model, inputs, 2)
    # pretend layer 2's w1 were left whole: the comparison is of the report, so edit it
    params = dict(report.params)
    name = "layers.2.feed_forward.w1.weight"
    params[name] = type(params[name])(**{**params[name].__dict__, "style": "replicate", "dim": None,
                                         "local_shape": params[name].global_shape})
    edited = type(report)(**{**report.__dict__, "params": params})
    view = block_view(edited, trace)
    assert view.block == "layers.0" and view.same == ["layers.0", "layers.1"]
    assert view.differing == {"layers.2": ["feed_forward.w1.weight: replicate 128x64 "
                                           "(block: colwise 64x64)"]}


def test_a_model_without_layers_is_drawn_whole_with_fallbacks_and_lines():
    torch.manual_seed(0)
    html = tpcompile.explain(workers.UnruledOpAttention(), (torch.randn(2, 8, 32),), 2, html=True)
    parsed = _parse(html)
    assert parsed.boxes and not any(inside for inside, _, _ in parsed.boxes)
    assert "no repeated block" in html
    assert re.search(r"<td>fallback</td><td><code>cumprod\w*</code>.*?has no sharding rule", html)


def test_cli_writes_the_page(tmp_path, capsys):
    out = tmp_path / "plan.html"
    assert main(["explain", "mlp", "--world-size", "2", "--quiet", "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert '<svg class="plan"' in out.read_text()
    assert main(["explain", "mlp", "--world-size", "2", "--quiet", "--html",
                 str(tmp_path / "missing" / "x.html")]) == 2
    assert "cannot write" in capsys.readouterr().err


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_bias_joins_its_weights_box():
    html = tpcompile.explain(_TwoLinears(), (torch.randn(2, 16),), 2, html=True)
    assert [(name, style) for _, name, style in _parse(html).boxes] == [
        ("up.weight", "colwise"), ("down.weight", "rowwise")]
    assert "up.weight + up.bias: colwise" in html


def test_vocabulary_parallel_embedding_has_its_own_colour_and_its_all_reduce():
    model = models.build("llama", n_layers=1)
    html = tpcompile.explain(model, models.example_inputs(model), 2, vocab_parallel=True, html=True)
    parsed = _parse(html)
    assert ("tok_embeddings.weight", "vocab") in {(n, s) for _, n, s in parsed.boxes}
    assert (False, "forward", "all_reduce") in parsed.marks  # the masked lookup's sum, outside
