"""Benchmark: `tpcompile.explain` of a Llama-7B-shaped model on meta tensors, no process group.

Usage: python -m bench.explain_llama7b [--world-size 8] [--layers 32] [--seq 2048] [--static]

``--static`` captures at the example's sizes (``explain(..., dynamic=False)``): the same report,
2.5x faster to capture.

Prints wall time per step (building on meta, torch.export capture, planning, rewriting one
rank's graph, building the report) and the peak resident memory of the process. The weights
are never allocated: a 6.7B-parameter model is planned in a few hundred MB.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import tpcompile
from tpcompile.tools import models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--static", action="store_true", help="static shapes: faster capture")
    args = p.parse_args()

    cfg = models.ModelConfig(vocab=32000, dim=4096, n_layers=args.layers, n_heads=32,
                             n_kv_heads=8, hidden=11008, max_seq=args.seq, bias=False)
    marks = [("start", time.perf_counter())]
    with torch.device("meta"):
        model = models.Llama(cfg)
    tokens = torch.zeros(2, args.seq, dtype=torch.long, device="meta")
    marks.append(("build on meta", time.perf_counter()))

    def progress(message: str) -> None:
        step = message.split(" ")[0]  # capturing / captured ... planning / rewriting
        marks.append(({"capturing": "(imports)", "captured": "capture (torch.export)",
                       "rewriting": "plan"}.get(step, step), time.perf_counter()))

    report = tpcompile.explain(model, (tokens,), args.world_size, progress=progress,
                               dynamic=not args.static)
    marks.append(("rewrite rank 0 + report", time.perf_counter()))
    text = str(report)
    marks.append(("str(report)", time.perf_counter()))

    n_params = sum(p.numel() for p in model.parameters())
    print(f"Llama-7B shape: {args.layers} layers, hidden 4096, 32 q / 8 kv heads, SwiGLU 11008, "
          f"vocab 32000 ({n_params / 1e9:.2f}B parameters), tokens 2x{args.seq}, "
          f"world size {args.world_size}, torch {torch.__version__}")
    for (_, t0), (name, t1) in zip(marks, marks[1:]):
        if name != "(imports)":
            print(f"  {name:<26} {t1 - t0:7.2f} s")
    print(f"  {'total':<26} {marks[-1][1] - marks[0][1]:7.2f} s")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak resident memory       {peak_mb:7.0f} MB")
    counts = report.collective_counts()
    print(f"  report: {len(text.splitlines())} lines, {len(report.params)} parameters, "
          f"collectives per step {counts}")


if __name__ == "__main__":
    main()
