"""The cost model behind ``tpcompile advise``: devices, FLOPs of a graph's matmuls, ring times.

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
  (:mod:`tpcompile.inspect.retained`), or for inference the KV cache (the key and value
  operands of every attention at the example's batch and sequence). ``usable_memory`` of the
  device is available (the rest: CUDA context, workspaces, fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from tpcompile.passes.planner.rules import contraction_flops, flops_of

__all__ = ["Device", "DEVICES", "CostModel", "matmul_flops", "ring", "ring_seconds", "peak_flops"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float        # dense tensor-core peak for bfloat16 / float16 matmuls, FLOP/s
    fp32_flops: float        # float32 peak without TF32 (PyTorch's default matmul precision)
    link_gbps: float         # GPU-to-GPU bandwidth per direction, Gbit/s
    memory_gib: float
    source: str


def _gbps(gigabytes_per_s_bidirectional: float) -> float:
    """NVIDIA quotes NVLink as total bidirectional GB/s; a ring sends one way: half, in Gbit/s."""
    return gigabytes_per_s_bidirectional / 2 * 8


DEVICES = {
    "h100": Device("NVIDIA H100 SXM5 80GB", 989e12, 67e12, _gbps(900), 80 * 1000**3 / 1024**3,
                   "NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 1,979 TFLOPS with sparsity "
                   "(989 dense), FP32 67 TFLOPS, 80 GB HBM3, NVLink 900 GB/s"),
    "h200": Device("NVIDIA H200 SXM 141GB", 989e12, 67e12, _gbps(900), 141 * 1000**3 / 1024**3,
                   "NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity "
                   "(989 dense), FP32 67 TFLOPS, 141 GB HBM3e, NVLink 900 GB/s"),
    "a100": Device("NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, _gbps(600), 80 * 1000**3 / 1024**3,
                   "NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB: BF16 312 TFLOPS dense, "
                   "FP32 19.5 TFLOPS, 80 GB HBM2e, NVLink 600 GB/s"),
    "a100-40gb": Device("NVIDIA A100 SXM4 40GB", 312e12, 19.5e12, _gbps(600), 40 * 1000**3 / 1024**3,
                        "NVIDIA A100 Tensor Core GPU datasheet, SXM4 40GB: BF16 312 TFLOPS dense, "
                        "FP32 19.5 TFLOPS, 40 GB HBM2, NVLink 600 GB/s"),
    "l40s": Device("NVIDIA L40S 48GB (PCIe)", 362e12, 91.6e12, _gbps(64), 48 * 1000**3 / 1024**3,
                   "NVIDIA L40S datasheet: BF16 362 TFLOPS dense (733 with sparsity), FP32 91.6 "
                   "TFLOPS, 48 GB GDDR6, PCIe Gen4 x16 64 GB/s (no NVLink)"),
}


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
