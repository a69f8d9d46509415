"""``experts="auto"``'s cost model for grouped-matmul experts: expert-TP against whole experts.

One MoE block, one training step (forward + backward), on the busiest rank, given the expert
count ``E``, each expert's width ``W`` (its hidden features: gate_up is ``2W x D``, down
``D x W``), the model width ``D``, the routed rows per step ``R`` (tokens x top-k), the ranks
``N`` and a :class:`Device`. Per cut it counts:

- *matmul FLOPs*: ``6 x rows x D x 3W`` (forward, then the input's and the weight's gradient).
  Expert-TP: every row, ``3W / N`` wide (``ceil``). Whole experts: the rows routed to the
  busiest rank's ``ceil(E / N)`` experts, full width. Routing decides those rows; under
  uniform routing a rank's count is binomial, and the busiest of ``N`` sits about
  ``sqrt(2 ln N)`` standard deviations above the mean: that is expert parallelism's load
  imbalance (a router trained to balance, as real ones are, keeps it near that).
- *bytes per rank*: the expert weights held (read once forward, twice backward), and the
  tensors between the two matmuls (read and written about three times a step): ``R x 3W / N``
  under expert-TP, ``R x 3W`` under whole experts, whose tensors keep every row.
- *calls*: the matmul calls of the six grouped matmuls a step runs, one per expert on a
  device whose grouped matmul loops over experts (transformers' CPU fallback), one per grouped
  matmul otherwise; whole experts add a host read of the offsets per forward grouped matmul.
- *all-reduce bytes*: the block output forward and its input's gradient backward,
  ``2 x tokens x D``, the same for both cuts (which is why they never decide).

Time is ``FLOPs / matmul rate + bytes / memory rate + calls x call time + all-reduce time``.
The :class:`~tpcompile.passes.planner.devices.Device` rates are the planner's device table's
(:mod:`tpcompile.passes.planner.devices`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpcompile.passes.planner.devices import Device

__all__ = ["ExpertCost", "expert_costs"]


@dataclass(frozen=True)
class ExpertCost:
    """One cut's cost for one block and step, on the busiest rank."""

    mode: str                # tensor | expert
    flops: float
    weight_bytes: float      # expert weights held
    activation_bytes: float  # the tensors between the two grouped matmuls
    calls: int
    allreduce_bytes: float
    seconds: float

    def __str__(self) -> str:
        return (f"{self.mode}: {self.seconds * 1e3:.2f} ms ({self.flops / 1e9:.2f} GFLOP, "
                f"{self.weight_bytes / 2**20:.1f} MiB weights, {self.calls} calls)")


def _busiest_rows(rows: int, share: float, ranks: int) -> float:
    """Rows routed to the busiest of ``ranks`` ranks that each hold ``share`` of the experts,
    under uniform routing: the binomial mean plus ``sqrt(2 ln N)`` standard deviations."""
    mean = rows * share
    spread = math.sqrt(2 * math.log(ranks)) * math.sqrt(rows * share * (1 - share)) if ranks > 1 else 0.0
    return min(float(rows), mean + spread)


def expert_costs(experts: int, width: int, model_width: int, rows: int, ranks: int,
                 device: Device, tokens: int | None = None,
                 dtype_bytes: int = 4) -> dict[str, ExpertCost]:
    """``{"tensor": ..., "expert": ...}``: both cuts of one grouped-matmul MoE block.
    ``tokens`` (rows / top-k) only sizes the all-reduces, which both cuts pay alike."""
    held = math.ceil(experts / ranks)
    ar = 2 * (tokens or 0) * model_width * dtype_bytes
    ar_s = 2 * (device.allreduce_s + 2 * (ranks - 1) / ranks * ar / 2 / device.allreduce_bytes)
    per_expert = 3 * width * model_width * dtype_bytes
    cuts = {
        # rows, width each row is multiplied at, experts held, rows kept between the matmuls,
        # width kept between them, matmul calls per grouped matmul, host reads per step
        "tensor": (rows, math.ceil(3 * width / ranks), experts, rows, math.ceil(3 * width / ranks),
                   experts, 0),
        "expert": (_busiest_rows(rows, held / experts, ranks), 3 * width, held, rows, 3 * width,
                   held, 2),
    }
    out = {}
    for mode, (busy, wide, n_held, kept, kept_wide, per_call, reads) in cuts.items():
        flops = 6 * busy * model_width * wide
        weights = n_held * per_expert * (wide / (3 * width) if mode == "tensor" else 1)
        activations = 3 * kept * kept_wide * dtype_bytes
        calls = 6 * (per_call if device.call_per_expert else 1)
        seconds = (flops / device.matmul_flops + (3 * weights + activations) / device.memory_bytes
                   + calls * device.call_s + reads * device.host_read_s + ar_s)
        out[mode] = ExpertCost(mode, flops, weights, activations, calls, ar, seconds)
    return out
