"""The one device table every cost model reads: what a rank's device does per second.

Two kinds of entry share :class:`Device`, each stating the numbers its readers use and leaving
the others None (no number is invented to fill a field):

- the planner's *rates*, ``cpu`` and ``cuda``: what a rank achieves (a large float32 matmul,
  elementwise bytes, a call, a host read, an all-reduce's ring). ``experts="auto"``
  (:mod:`~tpcompile.passes.planner.experts.cost`) and the chain-cost rule
  (:mod:`~tpcompile.passes.planner.chain_cost`, ``PlanOptions.chain_cost`` names one) price
  cuts with them. They are stated, not fitted: ``bench/experts.py`` measures the two expert
  cuts and reports whether the cheaper one here is the faster one there;
- ``advise``'s *datasheet presets* (``h100``, ``a100``, ...): peak FLOP/s per dtype, link
  bandwidth and memory, each with its source (:mod:`tpcompile.inspect.advise.costs` turns them into
  step times and fits).

It lives in the planner, the lowest layer that prices anything; ``inspect`` reads it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "DEVICES", "RATED", "PRESETS", "device_for"]


@dataclass(frozen=True)
class Device:
    """One rank's device: its rates (the planner's), its datasheet (``advise``'s), or both."""

    name: str
    source: str = ""
    # the planner's rates
    matmul_flops: float | None = None     # FLOP/s of a large float32 matmul on one rank
    memory_bytes: float | None = None     # bytes/s of elementwise ops and weight reads
    call_s: float | None = None           # one matmul call (Python dispatch, kernel launch)
    host_read_s: float | None = None      # reading a device tensor's values on the host (a sync)
    allreduce_bytes: float | None = None  # bytes/s of an all-reduce's ring
    allreduce_s: float | None = None      # an all-reduce's fixed latency
    call_per_expert: bool = False         # its grouped matmul runs one matmul per expert
    # the datasheet's
    bf16_flops: float | None = None       # dense tensor-core peak for bfloat16 / float16, FLOP/s
    fp32_flops: float | None = None       # float32 peak without TF32 (PyTorch's default)
    link_gbps: float | None = None        # GPU-to-GPU bandwidth per direction, Gbit/s
    memory_gib: float | None = None


def _gbps(gigabytes_per_s_bidirectional: float) -> float:
    """NVIDIA quotes NVLink as total bidirectional GB/s; a ring sends one way: half, in Gbit/s."""
    return gigabytes_per_s_bidirectional / 2 * 8


def _sheet(name: str, bf16: float, fp32: float, link: float, gb: float, source: str) -> Device:
    return Device(name, source, bf16_flops=bf16, fp32_flops=fp32, link_gbps=link,
                  memory_gib=gb * 1000**3 / 1024**3)


DEVICES = {
    # one gloo rank, one thread of a desktop / server core, transformers' looping fallback
    "cpu": Device("cpu", "stated: one thread of a desktop / server core", matmul_flops=40e9,
                  memory_bytes=4e9, call_s=20e-6, host_read_s=2e-6, allreduce_bytes=1e9,
                  allreduce_s=100e-6, call_per_expert=True),
    # an H100-class GPU, NVLink all-reduce, one grouped-matmul kernel per call
    "cuda": Device("cuda", "stated: an H100-class GPU with NVLink", matmul_flops=50e12,
                   memory_bytes=2e12, call_s=8e-6, host_read_s=30e-6, allreduce_bytes=150e9,
                   allreduce_s=20e-6),
    "h100": _sheet("NVIDIA H100 SXM5 80GB", 989e12, 67e12, _gbps(900), 80,
                   "NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 1,979 TFLOPS with sparsity "
                   "(989 dense), FP32 67 TFLOPS, 80 GB HBM3, NVLink 900 GB/s"),
    "h200": _sheet("NVIDIA H200 SXM 141GB", 989e12, 67e12, _gbps(900), 141,
                   "NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity "
                   "(989 dense), FP32 67 TFLOPS, 141 GB HBM3e, NVLink 900 GB/s"),
    "a100": _sheet("NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, _gbps(600), 80,
                   "NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB: BF16 312 TFLOPS dense, "
                   "FP32 19.5 TFLOPS, 80 GB HBM2e, NVLink 600 GB/s"),
    "a100-40gb": _sheet("NVIDIA A100 SXM4 40GB", 312e12, 19.5e12, _gbps(600), 40,
                        "NVIDIA A100 Tensor Core GPU datasheet, SXM4 40GB: BF16 312 TFLOPS dense, "
                        "FP32 19.5 TFLOPS, 40 GB HBM2, NVLink 600 GB/s"),
    "l40s": _sheet("NVIDIA L40S 48GB (PCIe)", 362e12, 91.6e12, _gbps(64), 48,
                   "NVIDIA L40S datasheet: BF16 362 TFLOPS dense (733 with sparsity), FP32 91.6 "
                   "TFLOPS, 48 GB GDDR6, PCIe Gen4 x16 64 GB/s (no NVLink)"),
}

# the entries that state the planner's rates, and those that state a datasheet
RATED = {key: d for key, d in DEVICES.items() if d.matmul_flops is not None}
PRESETS = {key: d for key, d in DEVICES.items() if d.memory_gib is not None}


def device_for(kind: str) -> Device:
    """The rates of a device type: ``cpu`` or any accelerator (a model planned on the meta
    device is taken to be bound for one)."""
    return RATED["cpu" if kind == "cpu" else "cuda"]
