"""Single-GPU checks: the rewrite's numerics and overhead at world size 1, one rank's shards.

    bash bench/gpu.sh overhead          # skips (exit 0) without a CUDA device
    bash bench/gpu.sh overhead --device cpu   # the rehearsal: the same code at tiny sizes

On Llama-3-8B-shaped layers (dim 4096, 32 query / 8 KV heads, hidden 14336, vocab 128256;
``--layers`` of them, 2 by default), bf16 on CUDA, forward + backward:

1. *Numerics at world size 1*: ``tpcompile.tools.numerics.compare`` of
   ``tpcompile.parallelize`` at world size 1 (identity plan, no collectives) against the model:
   the output's and the largest gradient's relative error.
2. *Overhead*: the model unsharded against that module, eager and ``torch.compile``'d. The
   ratios should be 1.00: whatever the rewrite adds to the graph costs time.
3. *Shards*: rank 0's step at world size N = 2, 4, 8 on a fake process group
   (``torch.testing._internal.distributed.fake_pg``: collectives return at once and compute
   nothing), so the time is the local matmuls and attention on 1/N of the heads and hidden
   features: tpcompile's module and ``parallelize_module`` with torchtitan's plan
   (bench/baselines.py, DTensor), each eager and compiled. Efficiency = (unsharded step / N) /
   shard step in the same mode: 100% when the smaller matmuls run as efficiently as the whole
   ones. The fake collectives make the numbers (not the timings) garbage, which is fine here.

Timing: CUDA events around each step after warm-up, median of ``--steps``; variants alternate
step by step so clock and thermal drift hit both. Prints a markdown table, writes
bench/results/gpu-overhead-<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tpcompile
from bench.baselines import parallelize_dtensor
from tpcompile.tools import models
from tpcompile.tools.numerics import compare

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


def _parse(argv=None) -> argparse.Namespace:
    """Llama-3-8B-shaped layers by default (dim 4096, 32/8 heads, hidden 14336, vocab 128256)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--no-dtensor", dest="dtensor", action="store_false",
                   help="leave out the parallelize_module (DTensor, torchtitan plan) shards")
    return p.parse_args(argv)


def _world_size_one(model, tokens, timed, args, options) -> tuple[dict, dict]:
    """Numerics of the identity plan against the model, and eager / compiled step medians."""
    _fake_world(1)
    tp1 = tpcompile.parallelize(model, (tokens,))
    c = compare(model, tp1, (tokens,))
    numerics = {"output_err": c.output_err, "max_grad_err": c.max_grad_err}
    base = _medians({"unsharded eager": _step(model, tokens),
                     "tpcompile ws 1 eager": _step(tp1, tokens),
                     "unsharded compiled": _step(torch.compile(model, fullgraph=True), tokens),
                     "tpcompile ws 1 compiled": _step(torch.compile(tp1, fullgraph=True,
                                                                    options=options), tokens)},
                    timed, args.steps, args.warmup)
    return numerics, base


def _shard_variants(model, tokens, ws: int, args, options) -> dict:
    """Rank 0's step at world size ``ws`` on a fake group: tpcompile's and DTensor's shards."""
    model.zero_grad(set_to_none=True)  # the copy for DTensor needs no gradients
    _fake_world(ws)
    tp = tpcompile.parallelize(model, (tokens,))
    out = {"tpcompile eager": _step(tp, tokens),
           "tpcompile compiled": _step(torch.compile(tp, fullgraph=True, options=options), tokens)}
    if args.dtensor:
        dt = parallelize_dtensor(copy.deepcopy(model), init_device_mesh(args.device, (ws,)))
        out["dtensor eager"] = _step(dt, tokens)
        out["dtensor compiled"] = _step(torch.compile(dt), tokens)
    return out


def main(argv=None) -> None:
    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device; skipped")
        return
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = models.build("llama", dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                         n_kv_heads=args.kv_heads, hidden=args.hidden, vocab=args.vocab,
                         max_seq=args.seq).to(args.device, dtype)
    tokens = models.example_inputs(model, args.batch, args.seq)[0].to(args.device)
    timed, options = _timer(args.device), tpcompile.compile_options()
    numerics, base = _world_size_one(model, tokens, timed, args, options)
    report = _Report(args, dtype, numerics)
    for name, s in base.items():
        report.add({"variant": name, "world_size": 1, "step_ms": 1e3 * s,
                    "vs_unsharded": s / base[name.replace("tpcompile ws 1", "unsharded")]})
    for ws in args.world_sizes:
        shards = _medians(_shard_variants(model, tokens, ws, args, options), timed, args.steps,
                          args.warmup)
        for name, s in shards.items():
            ref = base["unsharded " + name.split()[-1]]  # eager or compiled
            report.add({"variant": f"rank 0 of {ws}: {name}", "world_size": ws,
                        "step_ms": 1e3 * s, "vs_unsharded": s / ref, "efficiency": ref / ws / s})
    dist.destroy_process_group()


class _Report:
    """The table, a row at a time, and the JSON rewritten after each: a run cut short by a
    time limit keeps what it measured."""

    def __init__(self, args, dtype, numerics: dict):
        self.args, self.numerics, self.rows = args, numerics, []
        self.device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"{self.device}, Llama {args.layers} layers, dim {args.dim}, {args.heads}/"
              f"{args.kv_heads} heads, hidden {args.hidden}, vocab {args.vocab}, {args.batch}x"
              f"{args.seq} tokens, {dtype}, fwd+bwd, median of {args.steps}")
        print(f"world size 1 vs unsharded (eager, {dtype}): output rel err "
              f"{numerics['output_err']:.2e}, max grad rel err {numerics['max_grad_err']:.2e}\n")
        print("| variant | step ms | vs unsharded (same mode) | efficiency (unsharded / N / shard) |")
        print("|---|---:|---:|---:|", flush=True)

    def add(self, r: dict) -> None:
        self.rows.append(r)
        eff = f"{r['efficiency']:.0%}" if "efficiency" in r else "-"
        print(f"| {r['variant']} | {r['step_ms']:.1f} | {r['vs_unsharded']:.3f}x | {eff} |",
              flush=True)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"gpu-overhead-{self.args.device}.json").write_text(json.dumps(
            {"device": self.device, "torch": torch.__version__, "config": vars(self.args),
             "numerics": self.numerics, "rows": self.rows}, indent=1))


if __name__ == "__main__":
    main()
