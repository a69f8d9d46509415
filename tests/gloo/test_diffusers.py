"""diffusers' FLUX transformer (zoo/diffusers_models.py), planned and run on gloo ranks.

Its single-stream blocks join attention and MLP in one ``cat`` before ONE ``proj_out``: the
plan cuts q / k / v by heads and ``proj_mlp`` by columns, and ``proj_out`` row-parallel over
the rows of each rank's heads and MLP features (a joined root), with no gather anywhere; at 2
ranks the output and every gradient equal the unsharded model's (``-m slow``: CI runs the same
cut's numerics on the corpus's ``dit_single_stream`` at 2 and 4 ranks). Skips without diffusers.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import tpcompile
from tpcompile.tools.launch import run_on_ranks

pytest.importorskip("diffusers")
from zoo import diffusers_models  # noqa: E402

pytestmark = pytest.mark.dist

SINGLE = "transformer.single_transformer_blocks."
COLWISE = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "proj_mlp.weight")


def test_single_stream_blocks_cut_proj_out_by_heads_and_mlp_features():
    model = diffusers_models.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tpcompile.explain(model, diffusers_models.example_inputs(), 2)
    for block in (0, 1):
        styles = {name: report.params[f"{SINGLE}{block}.{name}"].style
                  for name in (*COLWISE, "proj_out.weight")}
        assert styles == {**dict.fromkeys(COLWISE, "colwise"), "proj_out.weight": "rowwise"}
        proj_out = report.params[f"{SINGLE}{block}.proj_out.weight"]
        assert [tuple(s) for s in proj_out.local_shapes] == [(32, 80)] * 2  # 32 + 128 rows, halved
    singles = [m for m in report.megatron if m.layer.startswith(SINGLE)]
    assert len(singles) == 2 and all(m.bound_forward == m.forward == 1 for m in singles), singles
    # the model at its bound (a gradient sync may be counted in the block beside its bound's)
    assert (sum(m.forward for m in report.megatron), sum(m.backward for m in report.megatron)) \
        == (sum(m.bound_forward for m in report.megatron),
            sum(m.bound_backward for m in report.megatron)), report.megatron
    assert not [c for c in report.collectives if c.op != "all_reduce"]


def _numerics(rank: int, world_size: int) -> tuple[float, float]:
    from tpcompile.tools.numerics import compare

    model, inputs = diffusers_models.build(), diffusers_models.example_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compare(model, tpcompile.parallelize(model, inputs), inputs)
    return c.output_err, c.max_grad_err


@pytest.mark.slow  # CI time: the joined root's numerics run in CI on the dit_single_stream idiom
def test_output_and_every_gradient_equal_the_unsharded_model():
    for out_err, grad_err in run_on_ranks(f"{Path(__file__).resolve()}:_numerics", 2):
        assert out_err <= 1e-5 and grad_err <= 1e-5, (out_err, grad_err)
