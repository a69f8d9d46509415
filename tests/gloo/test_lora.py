"""Frozen weights and LoRA on real gloo ranks (bodies in ``lora_workers.py``).

Hand-written LoRA on every block linear of the built-in Llama, peft on q_proj / v_proj and on
every linear of a tiny Hugging Face Llama: outputs and every adapter gradient against the
unsharded model (float32, 1e-5 relative), only adapters get gradients, the forward pays the
base model's 2 all-reduces per layer, each frozen base weight the base plan shards is held
1/N per rank, and after 3 AdamW steps the merged weights equal the unsharded run's. A frozen
HF Llama runs under ``torch.no_grad``. The plans themselves: ``tests/unit/test_lora_plans.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import LaunchedOnDemand
from tpcompile.tools.launch import run_on_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.dist

BODIES = str(Path(__file__).parent / "lora_workers.py")
LORA = ["llama", "peft_qv", "peft_all"]
# peft_all and frozen run at 4 ranks in CI too: they are rows of the README's support table
IN_CI = {2: ["llama", "peft_qv", "peft_all", "frozen"], 4: ["llama", "peft_all", "frozen"]}
SLOW = {4: ["peft_qv"]}
N_LAYERS = 2
KV_WEIGHTS = ("wk.base.weight", "wv.base.weight", "k_proj.base_layer.weight",
              "v_proj.base_layer.weight")


def _param(ws: int, name: str):
    return pytest.param(ws, name, marks=() if name in IN_CI.get(ws, ()) else pytest.mark.slow)


def _params(names: list[str]) -> list:
    return [_param(ws, n) for ws in (2, 4) for n in names]


@pytest.fixture(scope="module")
def results():
    """(world size, in CI) -> one launch's per-rank results."""
    def run(key):
        ws, in_ci = key
        names = (IN_CI if in_ci else SLOW)[ws]
        return run_on_ranks(f"{BODIES}:lora", ws, names, timeout=600)
    return LaunchedOnDemand(run)


def _cases(results, ws: int, name: str) -> list:
    per_rank = [r[name] for r in results[ws, name in IN_CI.get(ws, ())]]
    for c in per_rank:
        assert "error" not in c, c.get("error")
    return per_rank


@pytest.mark.parametrize("ws, name", _params(LORA))
def test_lora_outputs_gradients_and_merged_weights_match(results, ws, name):
    for c in _cases(results, ws, name):
        assert c["output_err"] <= 1e-5
        assert c["with_grad"] == c["trainable"]  # only the adapters
        for errs in ("grad_errs", "step_errs", "merged_errs"):
            worst = max(c[errs].items(), key=lambda kv: kv[1])
            assert worst[1] <= 1e-5, (errs, worst)
        assert c["missing_after_load"] == []


@pytest.mark.parametrize("ws, name", _params(LORA))
def test_lora_pays_the_base_forward_and_holds_base_shards(results, ws, name):
    for c in _cases(results, ws, name):
        assert c["collectives"]["forward"] == {"all_reduce": 2 * N_LAYERS}
        for weight, share in c["base_share"].items():
            # 2 kv heads cannot be split over 4 ranks: the base plan keeps k / v whole there
            whole = ws == 4 and weight.endswith(KV_WEIGHTS)
            assert share == (1.0 if whole else 1 / ws), weight


@pytest.mark.parametrize("ws, name", _params(["frozen"]))
def test_frozen_model_under_no_grad(results, ws, name):
    for c in _cases(results, ws, name):
        assert c["output_err"] <= 1e-5 and not c["requires_grad"]
        assert c["grad_syncs"] == {}
        assert c["styles"]["model.layers.0.self_attn.q_proj.weight"] == "colwise"
        assert c["styles"]["model.layers.0.mlp.down_proj.weight"] == "rowwise"
        assert c["local_shapes"]["model.layers.0.mlp.down_proj.weight"] == (64, 128 // ws)
