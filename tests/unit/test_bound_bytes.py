"""The bytes of Megatron's bound (tpcompile/inspect/bound/bound_bytes.py) against the bytes the
plan's collectives carry, on the idioms where the two used to disagree: the plan's all-reduces
are read from the rewritten graph, the bound's from the model, so each side checks the other.

Each case names the rule it rests on. Before it, the bound priced these models off by 256 bytes
to 48 KiB per block in both directions (bench/results/bound-bytes-2026-12-07.md).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tpcompile
from zoo import idioms

CASES = {
    # a packed in_proj's bias is split with its rows (a dim of the weight's rows), not whole
    "packed_weight_split": 2,
    # Mamba-2: A_log, D, dt_bias per head and the depthwise conv over x, B, C are cut; the
    # conv's B / C rows are summed with in_proj's whole rows
    "mamba2_one_group": 2,
    # a float64 cast of the input: the sum is taken at the float32 value before it
    "swiglu_cast_weights": 2,
    # MLA: the narrow latent and the rotary key (entering the cut heads), not the block input
    "mla_latent_rope_cat": 2,
    # Mamba: B and C, read by the scan over cut channels, have partial gradients
    "mamba_selective_scan": 2,
    # a router's probabilities scale the experts' partial sums: one sync at the probabilities
    "moe_modulelist_top2": 2,
    "moe_litgpt_index_put": 2,
    # the tokens before the stacked experts' dense copy; the combine einsum keeps the sum
    "moe_stacked_bmm": 2,
    "moe_einsum": 4,
    # a per-layer input multiplied into a column-parallel output enters the cut features
    "per_layer_inputs": 2,
    # reduced before the gate (scaled_partials): the gate's gradient is whole
    "dit_adaln_zero": 2,
    # a relative position bias per head is cut with the heads: no bytes of its own
    "t5_relative_bias": 2,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bound_bytes_are_the_plans(name):
    ws = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tpcompile.explain(idioms.build(name), idioms.example_inputs(name=name), ws)
    rows = report.megatron
    assert sum(m.bytes for m in rows) == sum(m.bound_bytes for m in rows), [
        (m.layer, m.bytes, m.bound_bytes) for m in rows]
    assert all((m.forward, m.backward) == (m.bound_forward, m.bound_backward) for m in rows)


class _TwoStreams(torch.nn.Module):
    """A block of two MLPs on two norms of one stream; the second's output feeds the next block,
    and the last block's leaves only detached (LTX-2's audio stream after its last block: no
    gradient comes back to it)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.up1, self.down1 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.up2, self.down2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        side = self.down2(torch.relu(self.up2(self.norm2(x))))
        return x + self.down1(torch.relu(self.up1(self.norm1(x)))), side


class _DetachedSide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_TwoStreams() for _ in range(2))

    def forward(self, x):
        x, side = self.layers[0](x)
        x, side = self.layers[1](x + torch.sigmoid(side))
        return x, side.detach()


def test_a_stream_no_gradient_comes_back_to_is_no_carrier():
    """The last block's second MLP input is synced in no backward (its output is detached):
    the bound does not count it either, so the plan is at it, not below it."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tpcompile.explain(_DetachedSide(), (torch.randn(2, 8, 32),), 2)
    rows = {m.layer: m for m in report.megatron}
    assert (rows["layers.1"].bound_forward, rows["layers.1"].bound_backward) == (2, 1)
    assert rows["layers.1"].bound_bytes < rows["layers.0"].bound_bytes
    assert [(m.bytes, m.forward, m.backward) for m in report.megatron] == [
        (m.bound_bytes, m.bound_forward, m.bound_backward) for m in report.megatron]
