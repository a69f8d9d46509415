"""Sharded == unsharded on real gloo ranks: outputs, every gradient, and 3 AdamW steps.

One spawn per world size runs every case of ``workers.CASES``; each test reads its own case.
Tolerances (float32): outputs and gradients 1e-5 relative, parameters after 3 steps 1e-4.
"""

from __future__ import annotations

import pytest

from support import cases, launch, workers

pytestmark = pytest.mark.dist

WORLD_SIZES = (2, 4)


@pytest.fixture(scope="module")
def results():
    return {ws: launch("numerics", ws, sorted(workers.CASES)) for ws in WORLD_SIZES}


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", sorted(workers.CASES))
def test_outputs_and_gradients_match(results, ws, name):
    for c in cases(results, ws, name):
        assert c["output_err"] <= 1e-5
        worst = max(c["grad_errs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert len(c["grad_errs"]) == len(c["local_shapes"])  # every parameter was compared


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", sorted(workers.CASES))
def test_three_adamw_steps_match(results, ws, name):
    for c in cases(results, ws, name):
        worst = max(c["step_errs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-4, worst


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", ["mlp", "gpt2", "gpt2_explicit_attention", "llama",
                                  "llama_explicit_attention"])
def test_one_all_reduce_per_block_each_way(results, ws, name):
    """Megatron's count: one all-reduce per attention and per MLP block, forward and backward."""
    c = cases(results, ws, name)[0]
    blocks = c["n_layers"] * (1 if name == "mlp" else 2)
    assert c["collectives"]["forward"] == {"all_reduce": blocks}
    # with 2 KV heads over 4 ranks too: wk and wv stay whole, and the gradients of k and v
    # are summed in the all-reduce of the attention input's gradient
    assert c["collectives"]["backward"] == {"all_reduce": blocks}
    if name.startswith("llama") and ws == 4:
        assert c["styles"]["layers.0.attention.wk.weight"] == "replicate"


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_megatron_styles(results, ws):
    styles = cases(results, ws, "llama")[0]["styles"]
    for layer in range(2):
        p = f"layers.{layer}."
        assert styles[p + "attention.wq.weight"] == "colwise"
        assert styles[p + "attention.wo.weight"] == "rowwise"
        assert styles[p + "feed_forward.w1.weight"] == "colwise"
        assert styles[p + "feed_forward.w3.weight"] == "colwise"
        assert styles[p + "feed_forward.w2.weight"] == "rowwise"
        assert styles[p + "attention_norm.weight"] == "replicate"
        assert styles[p + "attention.wk.weight"] == ("colwise" if ws == 2 else "replicate")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_uneven_shards_are_real_shards(results, ws):
    """6 heads, hidden 100 at 4 ranks: heads split 2,2,1,1, whole heads only; hidden 25 each."""
    per_rank = [r["llama_uneven"]["local_shapes"] for r in results[ws]]
    q = [s["layers.0.attention.wq.weight"][0] for s in per_rank]
    w1 = [s["layers.0.feed_forward.w1.weight"][0] for s in per_rank]
    assert sum(q) == 48 and all(n % 8 == 0 for n in q)  # head_dim 8: whole heads
    assert q == ([24, 24] if ws == 2 else [16, 16, 8, 8])
    assert sum(w1) == 100 and max(w1) - min(w1) <= 1
    mlp = [r["mlp_uneven"]["local_shapes"]["blocks.0.fc1.weight"][0] for r in results[ws]]
    assert sum(mlp) == 30 and max(mlp) - min(mlp) <= 1


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", ["unknown_op_fallback", "merged_heads_fallback"])
def test_unknown_op_is_gathered_visibly(results, ws, name):
    """Gathered for the op without a rule, the projections still column -> row; with batch and
    heads merged (a symbolic B) the scores are gathered and cut again tile by tile."""
    c = cases(results, ws, name)[0]
    assert "cumprod" in c["fallbacks"]
    assert c["styles"]["qkv.weight"] == "colwise" and c["styles"]["proj.weight"] == "rowwise"
    assert c["collectives"]["forward"] == {"all_gather": 1, "all_reduce": 1}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_frames_flipped_in_time_stay_cut_by_heads(results, ws):
    """``flip`` over the frames with the heads cut (SANA-WM): Megatron's plan, no gather (the
    input is data: no input gradient to sum in backward)."""
    c = cases(results, ws, "attention_backward_in_time")[0]
    assert [c["styles"][f"{p}.weight"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert not c["fallbacks"], c["fallbacks"]
    assert c["collectives"] == {"forward": {"all_reduce": 1}, "backward": {}}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_a_table_kept_as_an_attribute_is_cut_with_its_features(results, ws):
    """A plain tensor attribute export lifts as a constant, read along a column-parallel
    output's features: each rank holds its slice of it (the whole table raised a size
    mismatch on the ranks, SANA-WM's refiner); its numerics: the tests above."""
    c = cases(results, ws, "hidden_scaled_by_attribute")[0]
    assert c["styles"]["table"] == "colwise" and c["styles"]["down.weight"] == "rowwise"
    assert c["collectives"]["forward"] == {"all_reduce": 1}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_groups_repeated_to_heads_stay_cut(results, ws):
    """repeat_interleave(..., output_size=heads) on a groups shard: the projections stay column
    -> row (its numerics: the tests above; a global output_size made the ranks raise)."""
    styles = cases(results, ws, "groups_repeated_to_heads")[0]["styles"]
    assert styles["b.weight"] == styles["x.weight"] == "colwise" and styles["out.weight"] == "rowwise"


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_whole_chunk_differentiated_whole_stays_replicated(results, ws):
    """A kv head every rank computes whole, also read by the residual stream: sharded, the
    chain's gradient sync would count the residual's gradient once per rank (gradient error
    1.0); the planner keeps the fused weight whole and says why (its numerics: above)."""
    c = cases(results, ws, "whole_kv_read_whole")[0]
    assert c["styles"]["qkv.weight"] == "replicate"
    assert "differentiated whole on every rank" in c["reasons"]["qkv.weight"]


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_two_streams_share_one_gradient_sync(results, ws):
    """Joint attention over image tokens and context tokens a caption projection makes from
    the input (JoyImage, Motif): the two streams' q / k / v inputs share one backward
    all-reduce; the input's own sync (it requires no gradient) is a bucket of its own that
    never runs. Shared with the input, it kept the context stream out: 2 backward all-reduces."""
    c = cases(results, ws, "joint_streams_captioned")[0]
    assert c["styles"]["cap1.weight"] == "colwise" and c["styles"]["cap2.weight"] == "rowwise"
    assert {c["styles"][f"{s}.{p}.weight"] for s in ("image", "context") for p in "qkv"} \
        == {"colwise"}
    assert c["collectives"]["backward"] == {"all_reduce": 1}, c["collectives"]


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_one_head_attention_keeps_its_scores_whole(results, ws):
    """A one-head attention written out: q and k whole (cut along the head's features, the
    scores would be a T x T partial sum, all-reduced each step), v and o cut by the head's
    features; its numerics: the tests above."""
    c = cases(results, ws, "one_head_attention")[0]
    assert c["styles"]["q.weight"] == c["styles"]["k.weight"] == "replicate"
    assert "a product of two activations" in c["reasons"]["q.weight"], c["reasons"]
    assert c["styles"]["v.weight"] == "colwise" and c["styles"]["o.weight"] == "rowwise"
    assert c["collectives"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_a_latent_no_narrower_than_the_model_keeps_its_down_projection_whole(results, ws):
    """MLA whose latent (32 + 8 rope features) is wider than the model (32): the bound and the
    plan keep ``wkv_a`` whole and cut ``wq`` / ``wkv_b`` by heads, ``wo`` by rows; one
    all-reduce each way, the rope piece's sync in q's input's bucket; numerics above."""
    c = cases(results, ws, "latent_attention")[0]
    assert c["styles"]["wkv_a.weight"] == "replicate", c["styles"]
    assert c["styles"]["wq.weight"] == c["styles"]["wkv_b.weight"] == "colwise"
    assert c["styles"]["wo.weight"] == "rowwise"
    assert c["collectives"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_a_value_read_only_by_later_blocks_syncs_with_the_first_of_them(results, ws):
    """A text stream's output read by each image block's cross-attention: its gradient sync
    shares the first image block's first all-reduce, 6 backward in all (7 when it was keyed
    by the text block that made it); numerics above."""
    c = cases(results, ws, "text_then_image_blocks")[0]
    assert c["collectives"] == {"forward": {"all_reduce": 6}, "backward": {"all_reduce": 6}}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_a_text_encoding_every_block_reads_pays_one_sync(results, ws):
    """The text stream made by one MLP outside the blocks and read by both image blocks'
    cross-attention: one forward all-reduce for it and two per image block, one backward
    sync for it and two per image block (explain files its sync with the code that made it:
    tests/unit/test_report.py); numerics above."""
    c = cases(results, ws, "text_encoded_outside_the_blocks")[0]
    assert c["collectives"] == {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 5}}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_syncs_that_wait_on_none_of_each_other_share_one_all_reduce(results, ws):
    """Two streams, the first's two MLPs before the second's (LTX-2's video then audio):
    gradient syncs bucketed by their height in the order of waits, two backward all-reduces
    for the four MLP inputs (three when bucketed greedily in graph order); numerics above."""
    c = cases(results, ws, "two_streams_in_turn")[0]
    # forward: the streams' last partial sums carried into their sum, one all-reduce for both
    assert c["collectives"] == {"forward": {"all_reduce": 3}, "backward": {"all_reduce": 2}}
