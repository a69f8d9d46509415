"""Vocabulary parallelism, traced and sharded losses, tied tables, dropout, on gloo ranks."""

from __future__ import annotations

import pytest

from support import cases, launch

pytestmark = pytest.mark.dist
WORLD_SIZES = (2, 4)
NAMES = ["llama_vocab_parallel", "gpt2_vocab_parallel", "gpt2_vocab_sequence_parallel",
         "gpt2_traced_loss", "llama_traced_loss", "llama_loss_parallel"]


@pytest.fixture(scope="module")
def results():
    return {ws: launch("vocab", ws, NAMES) for ws in WORLD_SIZES}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_vocab_parallel_embedding(results, ws):
    for c in cases(results, ws, "llama_vocab_parallel"):
        cmp, plan = c["cmp"], c["plan"]
        assert cmp.output_err <= 1e-5 and cmp.max_grad_err <= 1e-5 and cmp.max_step_err <= 1e-4
        table = plan.params["tok_embeddings.weight"]
        assert table.style == "vocab"
        rows = [s[0] for s in table.local_shapes]
        assert sum(rows) == 97 and max(rows) - min(rows) <= 1  # uneven vocabulary, exact
        assert plan.styles()["output.weight"] == "colwise"  # the LM head cuts the vocabulary
        assert sum(s[0] for s in plan.params["output.weight"].local_shapes) == 97
        # one more forward all-reduce (the lookup's partial rows) and the logits' all-gather
        # (backward: each rank's logit gradient is its slice of the whole one); backward, the
        # head's input gradient is a partial sum: one more all-reduce, as any column chain's
        blocks = 4
        assert cmp.collectives["forward"] == {"all_reduce": blocks + 1, "all_gather": 1}
        assert cmp.collectives["backward"] == {"all_reduce": blocks + 1}


def _tied_table(plan, prefix: str):
    """GPT-2's one table under both names, cut by vocabulary rows (97 of them)."""
    (table,) = [p for p in plan.params.values() if f"{prefix}wte.weight" in p.aliases]
    assert set(table.aliases) == {f"{prefix}wte.weight", f"{prefix}lm_head.weight"}
    assert table.style == "vocab" and sum(s[0] for s in table.local_shapes) == 97
    return table


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_vocab_parallel_cuts_a_tied_table_and_gathers_its_logits(results, ws):
    for c in cases(results, ws, "gpt2_vocab_parallel"):
        cmp = c["cmp"]
        assert cmp.output_err <= 1e-5 and cmp.max_grad_err <= 1e-5 and cmp.max_step_err <= 1e-4
        _tied_table(c["plan"], "")
        assert cmp.collectives["forward"]["all_gather"] == 1  # the whole logits returned
        assert not any("did not apply" in n for n in c["plan"].notes)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_vocab_and_sequence_parallel_reduce_scatter_the_lookup(results, ws):
    for c in cases(results, ws, "gpt2_vocab_sequence_parallel"):
        cmp, plan = c["cmp"], c["plan"]
        assert cmp.output_err <= 1e-5 and cmp.max_grad_err <= 1e-5 and cmp.max_step_err <= 1e-4
        assert plan.by_fqn["wte.weight"].style == "vocab"
        # the lookup's partial rows go straight into sequence shards, as each block's sums
        blocks = 2  # models.build("gpt2"): 2 blocks of two row-parallel sums each
        assert cmp.collectives["forward"]["reduce_scatter"] == 2 * blocks + 1


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_tied_table_is_sharded_once_under_a_traced_loss(results, ws):
    for c in cases(results, ws, "gpt2_traced_loss"):
        cmp = c["cmp"]
        assert cmp.output_err <= 1e-5 and cmp.max_grad_err <= 1e-5 and cmp.max_step_err <= 1e-4
        assert not _tied_table(c["plan"], "lm.").grad_sync
        # the logits are never gathered: only all-reduces, two of them inside the loss
        assert set(cmp.collectives["forward"]) == {"all_reduce"}


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_lm_head_is_column_parallel_into_a_traced_loss(results, ws):
    for c in cases(results, ws, "llama_traced_loss"):
        cmp, plan = c["cmp"], c["plan"]
        assert cmp.output_err <= 1e-5 and cmp.max_grad_err <= 1e-5 and cmp.max_step_err <= 1e-4
        assert plan.styles()["lm.output.weight"] == "colwise"
        assert "all_gather" not in cmp.collectives["forward"]


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_loss_parallel_returns_local_logits(results, ws):
    for c in cases(results, ws, "llama_loss_parallel"):
        assert c["loss_err"] <= 1e-5
        assert max(c["grad_errs"].values()) <= 1e-5
        assert c["local_shape"][:2] == (2, 16) and c["local_shape"][2] in (24, 25, 48, 49)
        assert c["plan"].styles()["output.weight"] == "colwise"


@pytest.mark.parametrize("ws", [pytest.param(3, marks=pytest.mark.slow), 4])  # 3: CI time
def test_dropout(ws):
    for r in launch("dropout", ws):
        explicit, sdpa = r["explicit"], r["sdpa"]
        # dropout ops on sharded tensors draw the whole mask: exactly the unsharded model
        assert explicit["output_err"] <= 1e-5 and explicit["grad_err"] <= 1e-5
        assert explicit["replicas_equal"] and explicit["rng_equal"]
        # a partial sum passes through dropout (one mask on every rank) to the residual sum:
        # one forward all-reduce per parallel block, not one per branch
        parallel = r["parallel_block"]
        assert parallel["output_err"] <= 1e-5 and parallel["grad_err"] <= 1e-5
        assert parallel["replicas_equal"] and parallel["rng_equal"]
        one_per_layer = {"all_reduce": 2}  # two layers
        assert parallel["collectives"] == {"forward": one_per_layer, "backward": one_per_layer}
        # SDPA's own dropout uses per-rank generators: replicas and the default RNG agree,
        # and dropout did happen (the output differs from the reference's random draw)
        assert sdpa["replicas_equal"] and sdpa["rng_equal"]
        assert sdpa["output_err"] > 1e-3
