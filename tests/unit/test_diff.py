"""tpcompile.diff: unified and per-pass diffs of the rewrite, and the side-by-side HTML page."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

import tpcompile
from tpcompile.tools import models

VOID = {"meta", "br", "hr", "img", "input", "link", "wbr", "col"}


@pytest.fixture(scope="module")
def llama_diff():
    model = models.build("llama", n_layers=1)
    return tpcompile.diff(model, models.example_inputs(model), 2)


def changed(text: str, sign: str) -> list[str]:
    return [line[1:] for line in text.splitlines()
            if line.startswith(sign) and not line.startswith(sign * 3)]


def test_unified_diff_shows_shards_constants_and_collectives(llama_diff):
    text = str(llama_diff)
    added, removed = changed(text, "+"), changed(text, "-")
    assert any(line.endswith("wq.weight  # 32x64, shard of 64x64") for line in added)
    assert any(line.endswith("wq.weight  # 64x64") for line in removed)
    assert any("view.default(linear, [sym_size_int, sym_size_int_1, 4, 8])" in line for line in added)
    assert any("view.default(linear, [sym_size_int, sym_size_int_1, 8, 8])" in line for line in removed)
    inserted = {c.inserted_as for c in llama_diff.collectives}
    assert inserted == {"all_reduce", "all_reduce_1", "copy_into_chain", "copy_into_chain_1"}
    for name in inserted:
        assert any(line.strip().startswith(f"{name} = tpcompile_runtime_collectives_") for line in added)
    assert "# inserted collectives: copy_into_chain after mul_1 (backward all_reduce)" in text
    assert "= None" not in text  # the frees are noise


def test_each_pass_can_be_diffed_on_its_own(llama_diff):
    sections = llama_diff.unified(passes=True).split("# === pass ")[1:]
    by_pass = {s.split("\n", 1)[0]: s for s in sections}
    assert list(by_pass) == ["inline_autocast", "drop_dead_code", "split_bias", "constant_index_as_slice",
                             "functionalize_fresh_writes", "decompose_unruled", "localize",
                             "insert_collectives", "drop_unowned_experts",
                             "clone_converted_writes", "materialize_params",
                             "fuse_bias", "fuse_sequence_linears", "retarget_device"]
    assert "(no change)" in by_pass["inline_autocast"]  # no autocast scope in its forward
    assert "(no change)" in by_pass["clone_converted_writes"]  # Llama writes nothing in place
    assert "(no change)" in by_pass["drop_unowned_experts"]  # nor has looped experts
    assert "(no change)" in by_pass["functionalize_fresh_writes"]  # nor into fresh buffers
    assert "(no change)" in by_pass["split_bias"]  # Llama's linears have no bias
    assert "(no change)" in by_pass["decompose_unruled"]  # every op it shards has a rule
    assert "(no change)" in by_pass["retarget_device"]  # captured on the CPU, not on meta
    localize = changed(by_pass["localize"], "+")
    assert localize and all(" = torch.ops.aten." in line and ("view" in line or "expand" in line
                            or "reshape" in line) for line in localize)
    assert not any("tpcompile_runtime_collectives" in line for line in localize)
    assert sum("tpcompile_runtime_collectives" in line for line in changed(by_pass["insert_collectives"], "+")) == 4
    materialize = changed(by_pass["materialize_params"], "+")
    assert len(materialize) == 7 and all("shard of" in line for line in materialize)


def test_bias_split_and_fuse_are_visible_per_pass():
    model = models.build("mlp", n_layers=1)
    result = tpcompile.diff(model, models.example_inputs(model), 2, passes=True)
    sections = {s.split("\n", 1)[0]: s for s in str(result).split("# === pass ")[1:]}
    assert any("linear_bias = torch.ops.aten.add.Tensor" in line
               for line in changed(sections["split_bias"], "+"))
    assert any("linear_bias = torch.ops.aten.add.Tensor" in line
               for line in changed(sections["fuse_bias"], "-"))


class _TagBalance(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_html_page_is_well_formed_self_contained_and_names_every_collective(llama_diff):
    page = llama_diff.to_html(passes=True) + llama_diff.to_html()
    for html in (llama_diff.to_html(), llama_diff.to_html(passes=True)):
        parser = _TagBalance()
        parser.feed(html)
        parser.close()
        assert parser.errors == [] and parser.stack == []
        assert html.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "<link" not in page and "http" not in page
    assert 'class="l shard' in page and 'class="l partial' in page
    for c in llama_diff.collectives:
        assert f"<li><code>{c.inserted_as}</code>: {c.phase} <code>{c.op}</code>" in page
        assert re.search(f'class="l collective (ins|chg)" id="d0-{c.inserted_as}"><span class="n">'
                         f'\\d+</span><span class="m">[+~]</span>    {c.inserted_as} = ', page)


def test_html_page_folds_unchanged_runs_and_links_every_rewritten_node(llama_diff):
    html = llama_diff.to_html()
    anchors = set(re.findall(r'<div class="l[^"]*" id="(d0-\w+)"', html))
    links = re.findall(r'<a href="#(d0-\w+)"', html)
    assert links and set(links) == anchors  # every changed line of "after" is in the jump list
    assert {f"d0-{c.inserted_as}" for c in llama_diff.collectives} <= anchors
    assert "d0-layers_0_attention_wq_weight" in anchors  # a sharded parameter
    folds = re.findall(r'<input type="checkbox" class="fold" id="(d0-fold\d+)">', html)
    assert folds
    for fold in folds:  # one toggle shared by both columns, shown by a CSS rule of its own
        assert html.count(f'<label class="fold" for="{fold}">') == 2
        assert f"#{fold}:checked ~ .side .{fold} {{ display: block; }}" in html
    assert re.search(r"\u22ef \d+ unchanged lines", html)
    # folded lines are hidden, not dropped: the left column still holds every captured line
    left = re.findall(r"<h3>before</h3>(.*?)<h3>after", html, re.S)[0]
    shown = len(re.findall(r'<div class="l[ "]', left)) - left.count('<div class="l blank">')
    assert shown == len(llama_diff.stages[0][1].splitlines())
