"""The fingerprint ranks compare before their first collective: rank-independent, and a
mismatch message that names the first differing entry (the real all-gather runs in
tests/gloo/test_failures.py)."""

from __future__ import annotations

import torch

from support import rewrite_ranks
from tpcompile.tools import models
from tpcompile.runtime.agreement import digest, first_difference, mismatch_message, value_entries


def test_uneven_shards_give_every_rank_the_same_fingerprint():
    model = models.build("llama", dim=48, n_heads=6, n_kv_heads=2, hidden=100, vocab=97, n_layers=1)
    plan, entries, graphs = rewrite_ranks(model, models.example_inputs(model), 4)
    assert len({digest(e) for e in entries}) == 1
    assert len({gm.code for gm in graphs}) > 1  # local shape constants do differ per rank
    whats = [what for what, _ in entries[0]]
    assert any(w.startswith("captured node ") for w in whats)
    assert any(w.startswith("plan params ") for w in whats)
    calls = [text.split(" = ")[1] for what, text in entries[0] if what.startswith("collective ")]
    # g and f of attention and MLP; the attention's f also sums the gradients of k and v,
    # computed whole on every rank from the 2 KV heads kept whole on 4 ranks
    assert sorted(calls) == ["all_reduce"] * 2 + ["copy_all_into_chain", "copy_into_chain"]


def test_the_first_differing_entry_is_found():
    ref = [("a", "1"), ("b", "2"), ("c", "3")]
    assert first_difference(ref, ref) is None
    assert first_difference([("a", "1"), ("b", "9"), ("c", "9")], ref) == (1, "b: 9")
    assert first_difference(ref[:2], ref) == (2, "(no entry): ")


def test_the_message_groups_ranks_by_value():
    ref = [("a", "1"), ("b", "2")]
    firsts = [None, (1, "b: 7"), None, (1, "b: 7"), (0, "a: 5")]
    msg = mismatch_message(ref, firsts)
    assert msg.startswith("ranks planned differently; the first entry that differs (of the "
                          "captured graph, the plan and the rewritten graph's collectives) is "
                          "entry 0:\n")
    assert "  ranks [0, 1, 2, 3]: a: 1\n  rank 4: a: 5\n" in msg
    assert msg.endswith("hint: every rank must call parallelize with the same model code, "
                        "config, example input shapes and options")


def test_weight_checksums_tell_ranks_apart_and_skip_meta_tensors():
    same = [value_entries(models.build("mlp")) for _ in range(2)]
    assert same[0] == same[1] and same[0][0][0] == "values of blocks.0.norm.weight"
    assert digest(value_entries(models.build("mlp", seed=7))) != digest(same[0])
    with torch.device("meta"):
        assert value_entries(models.build("mlp")) == []
