"""load_full_state_dict from a Hugging Face save_pretrained directory (index + shard files):
each rank gets exactly its slices and reads about its shards' bytes, never the whole model."""

from __future__ import annotations

import json

import pytest
import torch

import tpcompile
from tpcompile.core.plan import PlanOptions
from tpcompile.core.shards import placements_by_fqn, take_shard
from tpcompile.passes import pipeline
from tpcompile.runtime.module import TPModule
from tpcompile.state.hf_checkpoint import INDEX, HFShardedSource

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, max_shard_size="100KB")
    return path, model.state_dict()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_reads_only_its_slices_from_the_shard_files(saved, world_size):
    path, full = saved
    files = set(json.loads((path / INDEX).read_text())["weight_map"].values())
    assert len(files) >= 3
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config())
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    planned = pipeline.plan(model, (tokens,), world_size, options=PlanOptions())
    buffers = tpcompile.buffers_of(lambda: transformers.LlamaForCausalLM(_config()))
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    place = placements_by_fqn(planned.plan)
    warm = TPModule(pipeline.rewrite(planned, 0, "tp")[0], planned.plan, 0, None)
    tpcompile.load_full_state_dict(warm, path, buffers=buffers)  # imports, not counted below
    for rank in range(world_size):
        gm, _ = pipeline.rewrite(planned, rank, "tp")
        tp = TPModule(gm, planned.plan, rank, None)
        source = HFShardedSource(path)
        before = _rchar()
        tpcompile.load_full_state_dict(tp, source, buffers=buffers)
        read = _rchar() - before
        local = tp.state_dict()
        for name, value in local.items():  # exactly this rank's slices
            assert torch.equal(value, take_shard(full[name], place.get(name), planned.plan.specs, rank)), name
        shard_bytes = sum(t.numel() * t.element_size() for t in local.values())
        headers = sum(h.base for h in source.headers.values())
        assert set(source.opened) <= files
        assert shard_bytes <= read <= shard_bytes + headers + 4096, (read, shard_bytes, headers)
        assert read < 0.6 * full_bytes  # far from the whole checkpoint (ws 2: 0.53, ws 4: 0.30)


def test_an_index_naming_absent_shards_is_refused(saved, tmp_path):
    path, _ = saved
    (tmp_path / INDEX).write_text((path / INDEX).read_text())  # the index without its files
    with pytest.raises(tpcompile.TPCompileError, match="shard files that are absent"):
        HFShardedSource(tmp_path)


def test_a_slice_is_read_straight_into_a_shards_rows_or_refused(saved):
    """``read_into`` fills a shard's narrowed rows in place (no staging copy) with exactly
    the slice ``read`` returns; a shard of another dtype, a shape that is not the slice's, or
    a layout whose rows are not contiguous is declined (False), and the loader copies."""
    path, full = saved
    source, name = HFShardedSource(path), "model.layers.0.mlp.down_proj.weight"  # 128 x 256
    for dim, start, stop in [(None, 0, None), (0, 32, 96), (1, 64, 192)]:
        want = full[name] if dim is None else full[name].narrow(dim, start, stop - start)
        # a rank's local tensor with this piece one part of it along the cut dim
        d = dim or 0
        shard = torch.zeros(*[n + 8 * (k == d) for k, n in enumerate(want.shape)])
        into = shard.narrow(d, 8, want.shape[d])
        assert source.read_into(name, dim, start, stop, into)
        assert torch.equal(into, want) and torch.equal(source.read(name, dim, start, stop), want)
        assert not shard.narrow(d, 0, 8).any()  # nothing written outside the piece
    assert not source.read_into(name, None, 0, None, torch.empty(128, 256, dtype=torch.float64))
    assert not source.read_into(name, None, 0, None, torch.empty(64, 256))
    assert not source.read_into(name, None, 0, None, torch.empty(256, 128).t())
    assert not source.read_into(name, 0, 0, 64, torch.empty(64, 264).narrow(1, 0, 256))
