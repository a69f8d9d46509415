"""tpcompile.explain on the built-in models, without any process group."""

from __future__ import annotations

import copy
import json
import math
from collections import Counter

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.tools import models
from tpcompile.api import plan_model, rewrite
from tpcompile.passes.rewrite.materialize_params import materialize_params_pass
from tpcompile.runtime.collectives import COLLECTIVE_FNS, count_collectives
from tpcompile.inspect.explain.explain import SCHEMA, Report

from support import workers


def explain_builtin(name, ws, dtype=torch.float32, **overrides):
    model = models.build(name, **overrides).to(dtype)
    return tpcompile.explain(model, models.example_inputs(model), ws), model


@pytest.fixture(scope="module")
def llama2():
    return explain_builtin("llama", 2)[0]


@pytest.fixture(scope="module")
def llama4_bf16():
    """2 KV heads on 4 ranks (wk / wv replicated in the attention), in bfloat16."""
    return explain_builtin("llama", 4, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def gpt2():
    return explain_builtin("gpt2", 2, n_layers=1)


def test_llama_style_dim_and_shapes_per_parameter(llama2):
    p = llama2.params
    expect = {  # fqn: (style, dim, global, local on rank 0) for dim 64, 8 q / 2 kv heads, hidden 128
        "layers.0.attention.wq.weight": ("colwise", 0, [64, 64], [32, 64]),
        "layers.0.attention.wk.weight": ("colwise", 0, [16, 64], [8, 64]),
        "layers.0.attention.wo.weight": ("rowwise", 1, [64, 64], [64, 32]),
        "layers.1.feed_forward.w3.weight": ("colwise", 0, [128, 64], [64, 64]),
        "layers.1.feed_forward.w2.weight": ("rowwise", 1, [64, 128], [64, 64]),
        "layers.0.ffn_norm.weight": ("replicate", None, [64], [64]),
        "output.weight": ("replicate", None, [128, 64], [128, 64]),
    }
    for fqn, (style, dim, whole, local) in expect.items():
        assert (p[fqn].style, p[fqn].dim, p[fqn].global_shape, p[fqn].local_shape) == \
            (style, dim, whole, local), fqn
    assert p["layers.0.attention.wq.weight"].chain == "layers.0.attention"
    assert llama2.chains["layers.0.attention"]["summary"] == "wq, wk, wv -> wo"
    assert p["output.weight"].chain == ""
    assert "all-gather where the model's output" in p["output.weight"].reason
    assert not p["rope_cos"].trainable


@pytest.mark.parametrize("case", ["llama4_bf16", "gpt2"])
def test_collectives_are_those_of_the_rewritten_graph(case, request):
    report, model = request.getfixturevalue(case)
    gm, _, _ = rewrite(model, models.example_inputs(model), report.world_size, rank=0)
    assert report.collective_counts() == count_collectives(gm)
    assert {c.inserted_as for c in report.collectives} == {
        n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_FNS}


def test_options_are_parallelizes_options():
    """explain(..., sequence_parallel=True, vocab_parallel=True) reports the plan those make."""
    model = models.build("gpt2", n_layers=1)
    inputs = models.example_inputs(model)
    options = {"sequence_parallel": True, "vocab_parallel": True}
    report = tpcompile.explain(model, inputs, 2, **options)
    gm, _, _ = rewrite(model, inputs, 2, rank=0, **options)
    counts = report.collective_counts()
    assert counts == count_collectives(gm)
    # one per row-parallel Linear, and the tied table's lookup (cut by vocabulary: its partial
    # rows are reduce-scattered into sequence shards, as Megatron's with sequence parallelism)
    assert counts["forward"]["reduce_scatter"] == 3
    assert report.collective_counts() != tpcompile.explain(model, inputs, 2).collective_counts()


def test_collective_bytes_come_from_shapes_and_dtypes(llama4_bf16):
    report, model = llama4_bf16
    cfg = model.cfg
    tokens = 2 * 16  # models.example_inputs: batch 2, sequence 16
    kv = cfg.n_kv_heads * cfg.dim // cfg.n_heads
    kinds = {(c.phase, c.op, c.node.split("_")[0]) for c in report.collectives}
    assert kinds == {("forward", "all_reduce", "linear"), ("backward", "all_reduce", "mul"),
                     ("backward", "all_reduce", "linear")}
    for c in report.collectives:
        assert c.dtype == "bfloat16"
        assert c.bytes == math.prod(c.shape) * 2
        if c.inserted_as.startswith("copy_all_into_chain"):
            # 2 kv heads on 4 ranks: wk / wv stay whole; the gradients of k and v ride in the
            # all-reduce of the attention input's gradient (one per layer, flattened)
            assert c.shape == [tokens * (cfg.dim + 2 * kv)]
        else:  # g after wo / w2, f after the MLP norm
            assert c.shape == [2, 16, cfg.dim]
    per_layer = Counter(c.layer for c in report.collectives if c.phase == "backward")
    assert set(per_layer.values()) == {2} and len(per_layer) == cfg.n_layers


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's own, from deepcopy of a GraphModule
def test_parameter_bytes_equal_each_ranks_materialized_shards():
    overrides = dict(n_layers=1, dim=48, n_heads=6, n_kv_heads=2, hidden=100, vocab=97)
    report, model = explain_builtin("llama", 4, **overrides)  # uneven: 2, 2, 1, 1 heads
    cap, plan = plan_model(model, models.example_inputs(model), 4)
    for rank in range(4):
        gm = materialize_params_pass(copy.deepcopy(cap.gm), plan, rank)
        held = sum(p.numel() * p.element_size() for p in gm.parameters())
        assert report.param_bytes_per_rank[rank] == held
    assert len(set(report.param_bytes_per_rank)) == 2
    assert report.param_bytes_total == sum(p.numel() * 4 for p in model.parameters())


def test_tied_weights_are_counted_once(gpt2):
    report, model = gpt2
    assert report.param_bytes_total == sum(p.numel() * 4 for p in model.parameters())
    assert report.params["lm_head.weight"].aliases == ["wte.weight", "lm_head.weight"]
    assert str(report).count("wte.weight = lm_head.weight") == 1


def test_json_has_the_documented_schema_and_round_trips(llama2):
    obj = json.loads(llama2.to_json())
    assert obj["schema"] == SCHEMA and obj["world_size"] == 2
    for key in ("params", "collectives", "param_bytes_per_rank", "param_bytes_total", "fallbacks",
                "chains", "kept_replicated", "megatron", "dtensor", "inputs"):
        assert key in obj, key
    wq = obj["params"]["layers.0.attention.wq.weight"]
    assert {"style": "colwise", "dim": 0, "global_shape": [64, 64], "local_shape": [32, 64]}.items() \
        <= wq.items()
    assert set(obj["collectives"][0]) >= {"op", "phase", "shape", "bytes", "node"}
    assert Report.from_json(llama2.to_json()) == llama2
    with pytest.raises(ValueError, match="schema"):
        Report.from_json(json.dumps({"schema": "other"}))


def test_megatron_bound_is_met_and_exceeded_where_it_should_be(llama2, llama4_bf16):
    assert [(m.layer, m.bound_forward, m.bound_backward, m.forward, m.backward)
            for m in llama2.megatron] == [("layers.0", 2, 2, 2, 2), ("layers.1", 2, 2, 2, 2)]
    assert all(m.bytes == m.bound_bytes == 4 * 2 * 16 * 64 * 4 for m in llama2.megatron)
    assert "-> at the bound" in str(llama2)
    # 2 KV heads on 4 ranks: wk / wv whole (2 heads, fewer than 4 ranks), their gradients
    # partial; the plan sums k's and v's in the attention input's all-reduce, and the bound
    # counts the smaller of those and the weights' (32 tokens < 64 features: the outputs')
    over, model = llama4_bf16
    assert [(m.forward, m.backward) for m in over.megatron] == [(2, 2), (2, 2)]
    tokens, kv_width = 2 * 16, model.layers[0].attention.wk.out_features
    inputs = 2 * tokens * 64 * 2  # forward + backward all-reduces of (tokens, dim), bfloat16
    assert all(m.bytes == m.bound_bytes == inputs * 2 + 2 * tokens * kv_width * 2
               for m in over.megatron)
    assert "-> at the bound\n" in str(over) + "\n"


def test_a_value_every_block_reads_is_counted_where_it_is_made_not_in_the_last_block():
    """The text encoding enters the cross-attention chains of both image blocks: its gradient
    sync serves neither alone and is filed with the code that made it, as the bound counts it
    (filed under the last block that read it, that block was judged one above the bound);
    its numerics: tests/gloo/test_numerics.py."""
    torch.manual_seed(0)
    report = tpcompile.explain(workers.TextEncodedOutsideTheBlocks(), (torch.randn(2, 8, 32),), 2)
    syncs = [c for c in report.collectives if c.phase == "backward"]
    assert [c.layer for c in syncs if c.module == "text"] == [""]
    assert [(m.layer, m.backward, m.bound_backward) for m in report.megatron] == [
        ("image.0", 2, 2), ("image.1", 2, 2), ("", 1, 1)]
    assert "-> at the bound" in str(report)


def test_fallback_ops_are_named():
    torch.manual_seed(0)
    model = workers.UnruledOpAttention()
    report = tpcompile.explain(model, (torch.randn(2, 8, 32),), 2)
    (fallback,) = report.fallbacks
    assert fallback["node"].startswith("cumprod")
    assert fallback["reason"].startswith("cumprod.default of S(") and "has no sharding rule" in fallback["reason"]
    assert fallback["module"] == ""
    assert any(c.op == "all_gather" and c.phase == "forward" for c in report.collectives)
    assert f"{fallback['node']} (top level): cumprod.default of S(" in str(report)


def test_text_report_has_every_section_and_every_collective(llama2):
    text = str(llama2)
    for heading in ("parameters (local shapes on rank 0)", "collectives per training step",
                    "parameter bytes per rank: 206,080 of 345,344", "fallbacks", "kept replicated",
                    "Megatron lower bound", "parallelize_module equivalent"):
        assert heading in text, heading
    for c in llama2.collectives:
        assert c.inserted_as in text


def test_dtensor_plan_maps_chains_and_says_what_it_cannot_express(llama2, gpt2):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = llama2.to_dtensor_plan()
    assert isinstance(plan["layers.0.feed_forward.w1"], ColwiseParallel)
    assert isinstance(plan["layers.0.feed_forward.w2"], RowwiseParallel)
    assert "layers.0.attention.wq" not in plan  # the model hard-codes n_heads in its views
    assert "view(B, T, -1, head_dim)" in llama2.not_expressible["layers.0.attention.wq"]
    with pytest.raises(tpcompile.TPCompileError, match="no parallelize_module equivalent"):
        llama2.to_dtensor_plan(strict=True)

    assert "per fused chunk" in gpt2[0].not_expressible["blocks.0.attn.c_attn"]
    assert set(gpt2[0].dtensor_plan) == {"blocks.0.c_fc", "blocks.0.c_proj"}
    # hidden 30 on 4 ranks: tpcompile's 8, 8, 7, 7 rows are not torch.chunk's 8, 8, 8, 6
    uneven = explain_builtin("mlp", 4, n_layers=1, dim=20, hidden=30)[0]
    assert uneven.dtensor_plan == {}
    assert "sizes 8, 8, 7, 7" in uneven.not_expressible["blocks.0.fc1"]
    even = explain_builtin("mlp", 2, n_layers=1)[0]
    assert even.dtensor_plan == {"blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise"}
    assert isinstance(even.to_dtensor_plan(strict=True)["blocks.0.fc2"], RowwiseParallel)


def test_llama_7b_shaped_model_is_planned_on_meta_tensors():
    """The 7B shapes (hidden 4096, 32 q / 8 kv heads, SwiGLU 11008, vocab 32000), 1 layer."""
    cfg = models.ModelConfig(vocab=32000, dim=4096, n_layers=1, n_heads=32, n_kv_heads=8,
                             hidden=11008, max_seq=128, bias=False)
    with torch.device("meta"):
        model = models.Llama(cfg)
    tokens = torch.zeros(2, 128, dtype=torch.long, device="meta")
    report = tpcompile.explain(model, (tokens,), 8)
    assert all(p.is_meta for p in model.parameters())
    p = report.params
    assert p["layers.0.attention.wq.weight"].local_shape == [512, 4096]
    assert p["layers.0.attention.wk.weight"].local_shape == [128, 4096]
    assert p["layers.0.feed_forward.w2.weight"].local_shape == [4096, 1376]
    counts = report.collective_counts()
    assert counts == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    assert {c.bytes for c in report.collectives} == {2 * 128 * 4096 * 4}
    per_layer = 2 * 4096 * 4096 // 8 + 2 * 1024 * 4096 // 8 + 3 * 11008 * 4096 // 8 + 2 * 4096
    assert report.param_bytes_per_rank[0] == 4 * (per_layer + 2 * 32000 * 4096 + 4096)


class SumExit(nn.Module):
    """A chain that also leaves through a sum over its sharded features, not a Linear."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return x + self.down(h) + h.sum(-1, keepdim=True)


class HeadGain(nn.Module):
    """A trainable per-head-dim gain inside the chain: replicated, its gradient all-reduced."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x):
        B, T, _ = x.shape
        h = torch.relu(self.up(x)).view(B, T, -1, 16) * self.gain
        return x + self.down(h.reshape(B, T, -1))


@pytest.mark.parametrize("model,why", [
    (SumExit, "partial sums of sum_1, which no row-parallel nn.Linear produces"),
    (HeadGain, "the gradient of gain, a replicated value used inside the chain"),
])
def test_dtensor_plan_leaves_out_chains_parallelize_module_would_get_wrong(model, why):
    report = tpcompile.explain(model(), (torch.randn(2, 8, 16),), 2)
    assert report.params["up.weight"].style == "colwise"  # tpcompile shards it, correctly
    assert report.dtensor_plan == {}
    assert set(report.not_expressible) == {"up", "down"}
    assert why in report.not_expressible["up"]


@pytest.mark.parametrize("family", ["electra", "cpmant"])
def test_explain_families_the_sweep_found_raising(family):
    """bench/hf_sweep.py found explain raising KeyError on these: Electra's row-parallel chain
    ends in a bias add the rewrite folds away (the bound read the rewritten graph), CpmAnt has
    get_attr nodes export leaves without meta['val']."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "electra":
        cfg = transformers.ElectraConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=128,
                                         tie_word_embeddings=True, is_decoder=True)
        model = transformers.ElectraForCausalLM(cfg)
    else:
        cfg = transformers.CpmAntConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, dim_head=16, dim_ff=128)
        model = transformers.CpmAntForCausalLM(cfg)
    report = tpcompile.explain(model, (torch.randint(0, 256, (2, 16)),), 2)
    layers = [m for m in report.megatron if m.layer]
    assert len(layers) == 2 and all(m.bound_forward == 2 for m in layers), report.megatron
    assert max(report.param_bytes_per_rank) < report.param_bytes_total


def test_bucketed_gradient_sync_of_data_dependent_sizes_reports_a_symbolic_message():
    """Values sized by routing (an expert's token count, unbacked) have no example size: the
    message shape of their bucketed sync stays symbolic instead of failing explain (JetMoe)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from tpcompile.inspect.traffic import _message_shape
    from tpcompile.runtime.collectives import copy_all_into_chain

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        tokens = env.create_unbacked_symint()
        k, v = torch.empty(tokens, 8), torch.empty(tokens, 8)
    g = torch.fx.Graph()
    nodes = [g.placeholder(name) for name in ("k", "v")]
    for n, val in zip(nodes, (k, v)):
        n.meta["val"] = val
    call = g.call_function(copy_all_into_chain, (nodes, "tp"))
    (shape,) = _message_shape(call, k)
    assert shape == f"{tokens}*8 + {tokens}*8"
    static = [torch.empty(4, 8, device="meta"), torch.empty(4, 2, device="meta")]
    for n, val in zip(nodes, static):
        n.meta["val"] = val
    assert _message_shape(call, static[0]) == [40]


def test_weights_the_bound_could_not_judge_are_named_never_at_the_bound_silently(llama2):
    """``Bound.undecided`` reaches the row of its layer: the text and HTML verdicts name each
    weight with its reason instead of a bare "at the bound", and JSON keeps them."""
    from dataclasses import replace

    from tpcompile.inspect.explain import explain_html

    why = "layers.1.attention.wq.weight: its matmul's features have no example size"
    rows = [replace(m, undecided=[why] if m.layer == "layers.1" else []) for m in llama2.megatron]
    report = replace(llama2, megatron=rows)
    text = str(report)
    assert f"-> at the bound; 1 weight(s) not judged, the bound counts without them: {why}" in text
    assert "-> at the bound\n" not in text + "\n"
    assert Report.from_json(report.to_json()) == report
    assert json.loads(report.to_json())["megatron"][1]["undecided"] == [why]
    html = explain_html._megatron(report)
    assert '<p class="over">' in html and "not judged" in html
    assert '<p class="ok">' in explain_html._megatron(llama2)
