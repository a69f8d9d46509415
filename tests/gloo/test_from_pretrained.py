"""A ``save_pretrained`` checkpoint directory to tokens on gloo ranks, never whole on a rank.

A tiny Llama (4 query / 2 kv heads, RoPE) is saved as sharded safetensors; each rank builds it
on the meta device, parallelizes it, reads its slices and generates: greedy tokens equal the
unsharded model's ``generate``, through ``tpcompile.from_pretrained`` and through the recipe it
wraps, with the RoPE tables recomputed from the config (no ``buffers_of`` factory) and every
tensor, the static cache's included, on CPU. CI: ``from_pretrained`` at 2 ranks; the recipe
by hand at 2 ranks and ``from_pretrained`` at 4 (fewer kv heads than ranks) are
``pytest -m slow``. The real-size benchmark's path (bench/generation_checkpoint.py: save,
``from_pretrained``, first tokens at a repeated and at new prompt lengths, decode steps, memory)
runs in CI on a tiny tied-embedding Llama.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.tools.launch import run_on_ranks

tf = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.dist

WORKERS = str(Path(__file__).parent / "pretrained_workers.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, list, list]:
    """The tiny Llama saved in 2 or more safetensors files, its greedy tokens and RoPE table."""
    from gloo.pretrained_workers import save_unsharded

    directory = tmp_path_factory.mktemp("llama")
    want, inv_freq = save_unsharded(str(directory))
    assert len(list(directory.glob("*.safetensors"))) >= 2
    return str(directory), want, inv_freq


def _check(per_rank: list, ws: int, path: str, want: list, inv_freq: list) -> None:
    for r in per_rank:
        got = r[path]
        assert got["tokens"] == want
        assert got["devices"] == ["cpu"]
        assert got["inv_freq"] == inv_freq
        # column- and row-parallel: this rank read its rows / columns only (hidden 64,
        # intermediate 128)
        assert got["q_proj"] == (64 // ws, 64) and got["down_proj"] == (64, 128 // ws)
        # from_pretrained cuts the vocabulary (vocab_parallel defaults to True there); the
        # recipe calls parallelize with its defaults, which keep the LM head whole
        cut = -(-got["vocab"] // ws) if path == "from_pretrained" else got["vocab"]
        assert got["lm_head_rows"] == cut


@pytest.mark.parametrize("ws, path", [
    (2, "from_pretrained"),
    pytest.param(2, "recipe", marks=pytest.mark.slow),
    pytest.param(4, "from_pretrained", marks=pytest.mark.slow),  # 2 kv heads on 4 ranks
])
def test_checkpoint_directory_generates_the_unsharded_tokens(checkpoint, ws, path):
    directory, want, inv_freq = checkpoint
    _check(run_on_ranks(f"{WORKERS}:from_checkpoint", ws, directory, [path]), ws, path, want,
           inv_freq)


TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True)


@pytest.mark.slow  # CI time: the bench's own path; the directory test above covers loading
def test_benchmark_path_on_a_tiny_checkpoint(tmp_path):
    """bench/generation_checkpoint.py's run, as for the 1B model: tokens equal the unsharded
    model's at two prompt lengths, new prompt lengths start no capture, every measure taken."""
    from bench import generation_checkpoint as module

    result = module.run(str(tmp_path), TINY_LLAMA, 2)
    assert len(result["ranks"]) == 2
    for r in result["ranks"]:
        assert r["tokens"] == result["reference"]["tokens"]
        assert r["new_length_captures"] == 0
        assert all(r[k] > 0 for k in ("parallelize_s", "load_s", "ttft_first_s",
                                      "ttft_repeated_s", "ttft_new_length_s", "step_module_s",
                                      "step_graph_s", "shard_bytes", "peak_rss", "ttft_ratio",
                                      "decode_ratio"))
        assert len(r["ttft_ratios"]) == len(module.NEW_LENGTHS)
        assert len(r["decode_ratios"]) == module.ROUNDS
    assert "| greedy tokens = unsharded" in module.table(result)
