"""The cost model behind ``tpcompile advise``: FLOPs of a graph's matmuls, ring times, fits.

Stated once here, printed by every ``advise`` run and documented in docs/visualize.md:

- **Compute**: matmul FLOPs only (``linear``, ``matmul``, ``mm``, ``bmm``, ``addmm``,
  ``baddbmm``: 2·M·N·K; ``scaled_dot_product_attention``: 2·Lk·(numel(q) + numel(out)), no
  causal discount), each at the share of it a rank computes under the plan (a sharded operand
  divides it; a replicated matmul is computed whole on every rank). A training step is the
  forward and a backward of twice its FLOPs. Time = FLOPs / (device peak for the model's dtype
  x ``compute_efficiency``). Elementwise ops, norms and softmax are not counted.
- **Communication**: ring algorithms over ``link`` bytes/s per direction per GPU x
  ``link_efficiency``: an all-reduce of B bytes over n ranks moves 2(n-1)/n·B per rank in
  2(n-1) steps, an all-gather or reduce-scatter (n-1)/n·B in n-1 steps; each step also costs
  ``step_latency``. Data parallelism: replicas all-reduce the gradients; FSDP2 all-gathers
  each unit's parameters in forward and again in backward and reduce-scatters its gradients
  (one ring per unit and collective). Nothing overlaps: compute, tensor-parallel collectives
  and data-parallel traffic add up (an upper bound; DDP and FSDP overlap the last with
  compute). Full activation checkpointing adds the checkpointed blocks' forward matmuls once
  more; selective recomputes no matmul.
- **Memory** per rank: parameters and buffers as the plan shards them; gradients in the
  parameters' dtype; Adam's two fp32 moments (+ an fp32 master copy of 16-bit parameters);
  under FSDP2 a 1/dp shard of each (dim 0 rounded up) plus the largest unit (a block, or the
  root) all-gathered and its unsharded gradients; activations = what rank 0's rewritten graph
  leaves alive for backward with the checkpointing mode, run on meta tensors
  (:mod:`tpcompile.inspect.advise.retained`), or for inference the KV cache (the key and value
  operands of every attention at the example's batch and sequence). ``usable_memory`` of the
  device is available (the rest: CUDA context, workspaces, fragmentation).

The device is a datasheet preset of the planner's one device table
(:data:`~tpcompile.passes.planner.devices.PRESETS`) or one the command line states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from tpcompile.passes.planner.devices import Device
from tpcompile.passes.planner.rules import contraction_flops, flops_of

__all__ = ["CostModel", "matmul_flops", "ring", "ring_seconds", "peak_flops"]

aten = torch.ops.aten


@dataclass(frozen=True)
class CostModel:
    device: Device
    compute_efficiency: float = 0.5   # share of peak FLOP/s a tuned training step reaches (MFU)
    link_efficiency: float = 0.8      # share of link bandwidth a ring reaches (nccl-tests busbw)
    step_latency: float = 5e-6        # seconds per ring step (launch + hop)
    usable_memory: float = 0.9        # share of device memory left for the model
    inference: bool = False           # forward only: no gradients, optimizer, backward or DP sync

    def assumptions(self) -> list[str]:
        d = self.device
        mode = ("inference: forward only; memory = parameters + buffers + KV cache" if self.inference
                else "training step: forward + backward (2x forward FLOPs); Adam (two fp32 moments, "
                     "fp32 master copy of 16-bit parameters), sharded 1/dp under FSDP2 plus its "
                     "largest unit gathered with its gradients; activations: what rank 0's graph "
                     "leaves alive for backward, run on meta tensors with the checkpointing mode")
        return [
            f"device: {d.name}: {d.bf16_flops / 1e12:g} TFLOP/s bf16/fp16, {d.fp32_flops / 1e12:g} "
            f"TFLOP/s fp32, link {d.link_gbps:g} Gbit/s ({d.link_gbps / 8:g} GB/s) per direction, "
            f"{d.memory_gib:.1f} GiB",
            f"  source: {d.source}",
            f"compute: matmul FLOPs per rank under the plan / (peak x {self.compute_efficiency:g})",
            f"communication: ring all-reduce 2(n-1)/n x bytes, all-gather / reduce-scatter "
            f"(n-1)/n x bytes, over link x {self.link_efficiency:g}, + {self.step_latency * 1e6:g} us "
            "per ring step; data parallelism over GPUs/TP ranks: replicas all-reduce gradients, "
            "FSDP2 all-gathers each unit's parameters twice (forward, backward) and "
            "reduce-scatters its gradients",
            "step time = compute + tensor-parallel collectives + data-parallel traffic "
            "(no overlap: an upper bound); full checkpointing recomputes its blocks' matmuls",
            f"memory fits when the total is within {self.usable_memory:.0%} of the device's",
            "batch: the global batch is GPUs x the example batch; each of the GPUs/TP "
            "data-parallel ranks runs TP x the example batch (the inputs' dim 0)",
            mode,
        ]


def peak_flops(device: Device, dtype: torch.dtype) -> float:
    return device.fp32_flops if dtype in (torch.float32, torch.float64) else device.bf16_flops


def ring(op: str, nbytes: int, ranks: int) -> tuple[float, int]:
    """(bytes each rank sends, ring steps) of one collective of a ``nbytes`` tensor."""
    if ranks <= 1 or not nbytes:
        return 0.0, 0
    steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
    return nbytes * steps / ranks, steps


def ring_seconds(moved: float, steps: int, cost: CostModel) -> float:
    """The time of ``steps`` ring steps sending ``moved`` bytes per rank in all."""
    link = cost.device.link_gbps * 1e9 / 8 * cost.link_efficiency
    return moved / link + steps * cost.step_latency


# the FLOPs of the ops with a rule are their rules' ``flops``; addmm with beta / alpha (split_bias
# leaves those) and baddbmm (BLOOM's alibi scores) have none to carry them: the planner gathers
# or decomposes them
_UNRULED = {aten.addmm.default: contraction_flops(1), aten.baddbmm.default: contraction_flops(1)}


def matmul_flops(node: fx.Node) -> tuple[float, list[fx.Node]]:
    """The whole (unsharded) forward FLOPs of ``node`` and the operands whose sharding divides
    them; (0, []) for an op the model does not count."""
    count = _UNRULED.get(node.target)
    return count(node) if count is not None else flops_of(node)
