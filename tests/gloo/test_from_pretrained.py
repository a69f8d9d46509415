"""A ``save_pretrained`` checkpoint directory to tokens on gloo ranks, never whole on a rank.

A tiny Llama (4 query / 2 kv heads, RoPE) is saved as sharded safetensors; each rank builds it
on the meta device, parallelizes it, reads its slices and generates: greedy tokens equal the
unsharded model's ``generate``, through ``tpcompile.from_pretrained`` and through the recipe it
wraps, with the RoPE tables recomputed from the config (no ``buffers_of`` factory) and every
tensor, the static cache's included, on CPU. CI: ``from_pretrained`` at 2 ranks; the recipe
by hand at 2 ranks and ``from_pretrained`` at 4 (fewer kv heads than ranks) are
``pytest -m slow``.
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
def checkpoint(tmp_path_factory) -> str:
    """The tiny Llama the workers compare with, saved in 2 or more safetensors shard files."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from generation_workers import hf_causal_lm

    directory = tmp_path_factory.mktemp("llama")
    hf_causal_lm("llama").save_pretrained(directory, max_shard_size="100KB")
    assert len(list(directory.glob("*.safetensors"))) >= 2
    return str(directory)


def _check(per_rank: list, ws: int, paths: list) -> None:
    for r in per_rank:
        for path in paths:
            got = r[path]
            assert got["tokens"] == r["want"], path
            assert got["devices"] == ["cpu"], path
            assert got["inv_freq"], path
            # column- and row-parallel: this rank read its rows / columns only (hidden 64,
            # intermediate 128)
            assert got["q_proj"] == (64 // ws, 64) and got["down_proj"] == (64, 128 // ws), path


@pytest.mark.parametrize("ws, path", [
    (2, "from_pretrained"),
    pytest.param(2, "recipe", marks=pytest.mark.slow),
    pytest.param(4, "from_pretrained", marks=pytest.mark.slow),  # 2 kv heads on 4 ranks
])
def test_checkpoint_directory_generates_the_unsharded_tokens(checkpoint, ws, path):
    _check(run_on_ranks(f"{WORKERS}:from_checkpoint", ws, checkpoint, [path]), ws, [path])
