"""Single-GPU checks: the rewrite's overhead at world size 1, and the shards' compute efficiency.

    bash bench/gpu.sh                  # skips (exit 0) without a CUDA device
    python -m bench.gpu --device cpu --layers 1 --dim 256 --steps 2   # a smoke run on CPU

1. *Overhead*: a Llama (bf16, torch.compile'd, forward + backward) unsharded against
   ``tpcompile.parallelize`` of the same model at world size 1 (identity plan, no collectives),
   also compiled. The ratio should be 1.00: whatever the rewrite adds to the graph costs time.
2. *Shard efficiency*: one rank's step at world size N = 2, 4, 8, on a fake process group
   (``torch.testing._internal.distributed.fake_pg``: collectives return at once and compute
   nothing), so the time is the local matmuls and attention on 1/N of the heads and hidden
   features. Efficiency = (unsharded step / N) / shard step: 100% when the smaller matmuls
   run as efficiently as the whole ones; lower means the shards are too thin for the GPU.
   The fake collectives make the numbers (not the timings) garbage, which is fine here.

Timing: CUDA events around each step after warm-up, median of ``--steps``; variants alternate
step by step so clock and thermal drift hit both. Prints a markdown table, writes
bench/results/gpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.tools import models

RESULTS = Path(__file__).resolve().parent / "results"


def _timer(device: str):
    """A function ``step -> seconds`` for ``device`` (CUDA events on GPUs)."""
    if device == "cuda":
        def timed(step):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        return timed

    def timed_cpu(step):
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    return timed_cpu


def _step(module, tokens):
    def run():
        module(tokens).float().pow(2).mean().backward()
    return run


def _fake_world(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _medians(variants: dict, timed, steps: int, warmup: int) -> dict:
    times = {name: [] for name in variants}
    for i in range(warmup + steps):
        for name, step in variants.items():
            seconds = timed(step)
            if i >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=11008)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device; skipped")
        return
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = models.build("llama", dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                         n_kv_heads=args.kv_heads, hidden=args.hidden, vocab=32000,
                         max_seq=args.seq).to(args.device, dtype)
    tokens = models.example_inputs(model, args.batch, args.seq)[0].to(args.device)
    timed = _timer(args.device)
    options = tpcompile.compile_options()

    _fake_world(1)
    tp1 = tpcompile.parallelize(model, (tokens,))
    whole = torch.compile(model, fullgraph=True)
    base = _medians({"unsharded": _step(whole, tokens),
                     "tpcompile ws 1": _step(torch.compile(tp1, fullgraph=True, options=options),
                                             tokens)}, timed, args.steps, args.warmup)
    rows = [{"variant": name, "world_size": 1, "step_ms": 1e3 * s,
             "vs_unsharded": s / base["unsharded"]} for name, s in base.items()]
    del tp1
    for ws in args.world_sizes:
        _fake_world(ws)
        shard = torch.compile(tpcompile.parallelize(model, (tokens,)), fullgraph=True,
                              options=options)
        s = _medians({"shard": _step(shard, tokens)}, timed, args.steps, args.warmup)["shard"]
        rows.append({"variant": f"rank 0 shard, N={ws}", "world_size": ws, "step_ms": 1e3 * s,
                     "vs_unsharded": s / base["unsharded"],
                     "efficiency": base["unsharded"] / ws / s})
        del shard
    dist.destroy_process_group()

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, Llama {args.layers} layers, dim {args.dim}, {args.heads}/{args.kv_heads} heads, "
          f"hidden {args.hidden}, {args.batch}x{args.seq} tokens, {dtype}, compiled fwd+bwd, "
          f"median of {args.steps}\n")
    print("| variant | step ms | vs unsharded | efficiency (unsharded / N / shard) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        eff = f"{r['efficiency']:.0%}" if "efficiency" in r else "-"
        print(f"| {r['variant']} | {r['step_ms']:.1f} | {r['vs_unsharded']:.3f}x | {eff} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"gpu-{args.device}.json").write_text(json.dumps(
        {"device": name, "torch": torch.__version__, "config": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
