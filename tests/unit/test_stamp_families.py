"""Block reuse (the default) on every Hugging Face family of the CI set: the same plan, byte
for byte, as a whole capture (``reuse_blocks=False``), and the same graph.

Each family is built from its tiny config (bench/hf_configs.py) with :data:`LAYERS` layers
(more where its blocks repeat with a period: three periods are exported, four needed), then
planned at 2 ranks both ways. Where the blocks are reused the plans' JSON is equal; where a
family's blocks cannot be reused the plan's note names why (:data:`WHOLE`), and the plan is
the whole capture's but for that note.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import hf_configs
from bench.hf_sweep import REPRESENTATIVE
from tpcompile.passes import pipeline

pytest.importorskip("transformers")

LAYERS = 4
PERIODIC = {"Gemma2ForCausalLM": 8}  # sliding / full attention alternate: period 2

# families captured whole, and what the plan's note says
WHOLE: dict[str, str] = {
    "MptForCausalLM": "reads a block other than the one before it",  # ALiBi, built in block 0
    "DeepseekV3ForCausalLM": "the exported blocks trace to different graphs",
    # GPT2Attention computes with self.layer_idx (scale_attn_by_inverse_layer_idx): blocks
    # whose forward may run per-index code are not stamped
    "GPT2LMHeadModel": "differs from block 1",
}
# over a minute each on the shared 2-core machine (Mamba-2 / gated delta rule scans, MoE
# routing): run with -m slow
SLOW = {"BambaForCausalLM", "Qwen3_5ForCausalLM", "GptOssForCausalLM", "FalconForCausalLM",
        "DeepseekV3ForCausalLM"}


# in CI: a plain stamped family, the periodic one, one captured whole by index use, and
# post-LN; the other representatives with -m slow (CI time)
IN_CI = {"LlamaForCausalLM", "Gemma2ForCausalLM", "GPT2LMHeadModel", "ElectraForCausalLM",
         "Qwen3ForCausalLM", "CohereForCausalLM"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow)
                                    if f in SLOW or f not in IN_CI else f
                                    for f in REPRESENTATIVE])
def test_family_plans_byte_identically_with_and_without_block_reuse(family, monkeypatch):
    monkeypatch.setattr(hf_configs, "LAYERS", PERIODIC.get(family, LAYERS))
    model, ids = hf_configs.build(family), hf_configs.example_ids()
    whole = pipeline.plan(model, (ids,), 2, reuse_blocks=False)
    reused = pipeline.plan(model, (ids,), 2)
    assert reused.cap.gm.code == whole.cap.gm.code
    added = [n for n in reused.plan.notes if n not in whole.plan.notes]
    if family in WHOLE:
        assert reused.cap.reused is None
        assert len(added) == 1 and WHOLE[family] in added[0], added
        assert replace(reused.plan, notes=whole.plan.notes).to_json() == whole.plan.to_json()
    else:
        assert reused.cap.reused[1] == PERIODIC.get(family, LAYERS), added
        assert reused.plan.to_json() == whole.plan.to_json()
