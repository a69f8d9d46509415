"""``TPModule.generate`` on Hugging Face causal LMs (tiny random configs), on gloo ranks.

Greedy decoding returns exactly ``model.generate``'s tokens on a left-padded batch; sampling
(top-k, top-p, temperature) with the unsharded model's seed returns its tokens too, on every
rank although the ranks are seeded apart (tokens are chosen on one rank and broadcast). The
static KV cache is sharded on kv heads, the parameters are the module's own shards, and a
decode step issues one all-reduce per attention block and one per MLP block. Prompts of
other lengths and other numbers of new tokens reuse the captures of their cache bucket.

CI runs Llama (GQA) and GPT-2 (Conv1D, fused c_attn) at 2 ranks, and a Llama with fewer kv
heads than ranks (8 query heads over 2 kv heads) at 4; the same over 1 kv head (MQA) and
every family at 2 and 4 ranks are ``pytest -m slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.tools.launch import run_on_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

WORKERS = str(Path(__file__).parent / "generation_workers.py")
FAST = ["llama", "gpt2"]  # at 2 ranks
ALL = ["llama", "qwen2", "mistral", "gpt2", "qwen3"]
# (query heads, kv heads) of the tiny configs (hidden 64)
HEADS = {"gpt2": (4, 4), "llama_8q2kv": (8, 2), "llama_mqa": (8, 1)}
HEAD_DIM = {"qwen3": 128}  # Qwen3Config's own head_dim; the others: hidden / query heads
# cache: the prompt and 4 new tokens in the smallest bucket, the models' 64 positions
LAYERS, BATCH, CACHE_LEN, HIDDEN = 2, 2, 64, 64


def covered_kv_heads(hq: int, hk: int, ws: int, rank: int) -> int:
    """The kv heads a rank's query heads read (its share of hq heads cut evenly in order)."""
    per = hq // ws
    return len({h // (hq // hk) for h in range(rank * per, (rank + 1) * per)})


def _check(ws: int, per_rank: list, names: list, sampled: bool = True) -> None:
    for name in names:
        hq, hk = HEADS.get(name, (4, 2))
        for c in (r[name] for r in per_rank):
            assert c["tokens"] == c["want"], name
            assert c["shared"], name
            if sampled:
                assert c["sampled"] == c["sample_want"], name
                assert c["beams"].startswith("InputError: tpcompile's generate() decodes greedily")
            # each rank holds the kv heads its query heads read: 1/N of them when they divide
            heads = covered_kv_heads(hq, hk, ws, c["rank"])
            for shape in c["caches"].values():
                assert shape[1] == heads, (name, shape)
            head_dim = HEAD_DIM.get(name, HIDDEN // hq)
            k_and_v = 2 * LAYERS * BATCH * heads * CACHE_LEN * head_dim * 4  # float32
            assert c["cache_bytes"] == k_and_v, name
            assert len(c["collectives"]) == 2  # prefill and decode captures
            assert c["logit_rows"] == [1, 1], name  # the prefill's last position only
            for graph in c["collectives"]:
                assert graph == {"all_reduce": 2 * LAYERS}, (name, graph)


@pytest.fixture(scope="module")
def fast():
    return run_on_ranks(f"{WORKERS}:hf_generate", 2, FAST, True)  # one launch for CI


def test_llama_and_gpt2_generate_the_unsharded_tokens(fast):
    _check(2, fast, FAST)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 4])
def test_every_family_generates_the_unsharded_tokens(ws):
    _check(ws, run_on_ranks(f"{WORKERS}:hf_generate", ws, ALL), ALL)


@pytest.mark.parametrize("name", ["llama_8q2kv", pytest.param("llama_mqa", marks=pytest.mark.slow)])
def test_fewer_kv_heads_than_ranks_cache_only_the_heads_read(name):
    """8 query heads over 2 kv heads (GQA; CI) and over 1 (MQA; slow) at 4 ranks: each rank's
    cache holds the one kv head its 2 query heads read (half the GQA cache), tokens unchanged.
    Greedy only: sampling takes the same path (the 2-rank tests and the slow sweep check it)."""
    per_rank = run_on_ranks(f"{WORKERS}:hf_generate", 4, [name], False, False)
    _check(4, per_rank, [name], sampled=False)


def test_vocab_parallel_generation_cuts_the_head_and_gathers_the_last_logits():
    """``vocab_parallel=True`` (``from_pretrained``'s default): Llama's own LM head and GPT-2's
    tied table hold vocab / N rows in the generation captures too; each graph gathers its
    last position's logits once and adds the lookup's all-reduce; greedy and sampled tokens
    are the unsharded model's."""
    per_rank = run_on_ranks(f"{WORKERS}:vocab_generate", 2, FAST)
    for c in (r[name] for r in per_rank for name in FAST):
        assert c["tokens"] == c["want"] and c["sampled"] == c["sample_want"]
        local, vocab = c["head_rows"]
        assert local == vocab // 2
        assert c["collectives"] == [{"all_reduce": 2 * LAYERS + 1, "all_gather": 1}] * 2


def test_a_deep_models_generation_captures_reuse_its_blocks():
    """6 layers: the prefill and decode captures export three blocks and stamp the rest, each
    with its own KV cache (no note of a whole capture); tokens are the unsharded model's and
    each graph pays one all-reduce per attention and per MLP block."""
    for c in run_on_ranks(f"{WORKERS}:deep_generate", 2):
        assert c["equal"] and c["notes"] == []
        assert c["collectives"] == [{"all_reduce": 12}] * 2


def test_generate_after_training_uses_the_updated_shards(fast):
    """3 SGD steps on the module and on the unsharded model, then greedy generation."""
    for c in (r["train"] for r in fast):
        assert c["tokens"] == c["want"]
        assert c["want"] != c["before"]  # training changed what the model generates
        assert c["loss_err"] <= 1e-5


@pytest.mark.parametrize("ws, name", [(2, "llama"), pytest.param(4, "llama_8q2kv",
                                                                   marks=pytest.mark.slow)])
def test_prompt_lengths_share_one_capture_per_cache_bucket(ws, name):
    """Prompts of 1 to 9 tokens with 2 to 9 new ones (left-padded): one prefill and one decode
    capture serve them all (the 64-position bucket); 60 + 40 tokens capture the 128 bucket and
    release the first bucket's cache, which a short prompt then reuses without a capture.
    Tokens equal the unsharded model's throughout."""
    for per_rank in run_on_ranks(f"{WORKERS}:prompt_lengths", ws, name):
        assert all(c["equal"] for c in per_rank)
        assert [c["captures"] for c in per_rank] == [2, 2, 2, 2, 2, 4, 4]
        assert [c["buckets"] for c in per_rank] == [[64]] * 5 + [[64, 128], [128, 64]]
        assert [c["cache_held"] for c in per_rank] == [[True]] * 5 + [[False, True]] * 2


def test_decode_steps_after_the_first_skip_the_checks_they_repeat():
    """check_calls="new": the prefill and the first decode step go through the module (its
    checks, the ranks' agreement), the 2 later steps call the decode graph; "every" checks all
    4 calls. A pad token outside the vocabulary is refused before the loop feeds it. The
    captures and a new prompt length print nothing (export's "... specialized; Dim.AUTO was
    specified ..." notes included) and raise no Python warning."""
    for c in run_on_ranks(f"{WORKERS}:decode_calls", 2):
        assert c["new"] == {"equal": True, "module_calls": 2}
        assert c["every"] == {"equal": True, "module_calls": 4}
        assert c["new stderr"] == c["every stderr"] == ""
        assert c["bad_pad"].startswith("InputError: input input_ids: token id 999 is out of range")


@pytest.mark.slow  # CI time: a performance property, and its numbers are a benchmark's
def test_python_calls_outside_the_graphs_do_not_grow_with_the_layers():
    """A warm greedy ``generate``'s Python function calls outside the model's graphs (checks,
    flattening, the cache's reset, the loop) are the same for a 2- and a 4-layer Llama, per
    call and per decode step: only the graphs' own code grows with the layers. A decode step
    after the first calls its graph's forward with no check around it: its Python is the
    loop's (the token broadcast's wrappers, the logits processors, the step's inputs; about
    20 calls in torch 2.13), well under torch.export's own input check (about 150)."""
    for c in run_on_ranks(f"{WORKERS}:python_calls", 2):
        assert all(v["length"] == new for (_, new), v in c.items())  # no early stop
        for new in (2, 6):
            assert c[(2, new)]["calls"] == c[(4, new)]["calls"]
        assert (c[(2, 6)]["calls"] - c[(2, 2)]["calls"]) / 4 < 50


@pytest.mark.slow
def test_compiled_generate_matches_eager():
    """``tp.compile_generation``: decode steps through torch.compile (inductor), same tokens."""
    for c in run_on_ranks(f"{WORKERS}:hf_compiled_generate", 2):
        assert c["used"]
        assert c["compiled"] == c["eager"] == c["want"]
