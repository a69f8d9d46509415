"""Planning scale: capture + plan + rewrite time and peak memory of Llama-shaped models on meta.

    python -m bench.planning                     # the sweep: markdown table, JSON in results/
    python -m bench.planning --quick             # a shorter sweep (a minute on 2 cores)
    python -m bench.planning --breakdown         # where a 7B capture's time goes (~40 s)
    python -m bench.planning --reuse             # 7B, 70B, 405B: whole export vs reused blocks

Each point runs in a fresh subprocess, so its peak resident memory (``ru_maxrss``) is its own
and no cache (fake-tensor, sympy, linecache) carries over from a smaller model. A point is what
one rank of ``parallelize`` does before its first collective: ``capture`` (torch.export with
dynamic batch and sequence dims), ``plan`` (split biases, propagate placements, freeze the
plan) and ``rewrite`` (the rank-0 pass pipeline: local shapes, collectives, shards on meta).
The weights are never allocated.

Two shapes, as in the Llama 2 papers: *7B* (hidden 4096, 32 query / 32 KV heads would be
Llama 2; here 8 KV heads as in the other benchmarks, SwiGLU 11008) and *70B* (hidden 8192, 64
query / 8 KV heads, SwiGLU 28672), both vocabulary 32000, 2 x 2048 tokens, world size 8.
The 7B and 70B points are also measured with static shapes, as ``plan_model(...,
dynamic=False)`` and ``explain(..., dynamic=False)`` capture (planning that never runs the graph
at other sizes). Growth is judged per captured graph node: seconds per node at the smallest and the largest
point, and a least-squares line ``seconds = a + b * nodes`` with its worst relative residual.

``--reuse`` measures the three largest shapes (7B 32 layers, 70B 80 layers, and *405B*: hidden
16384, 128 query / 8 KV heads, SwiGLU 53248, vocabulary 128256, 126 layers) twice, side by
side: the whole model exported (before) and ``reuse_blocks=True`` (after: three blocks
exported, the others stamped from one, ``tpcompile/core/stamp.py``).

``--breakdown`` times torch.export alone on the 7B shape (median of 3 interleaved rounds) three
ways (dynamic dims with FX stack
traces, as before this benchmark's optimisation; dynamic without them, as shipped; static
shapes) to show what the dynamic dims and the stack traces cost.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "7B": dict(dim=4096, n_heads=32, n_kv_heads=8, hidden=11008),
    "70B": dict(dim=8192, n_heads=64, n_kv_heads=8, hidden=28672),
    "405B": dict(dim=16384, n_heads=128, n_kv_heads=8, hidden=53248, vocab=128256),
}
SWEEP = [("7B", 2), ("7B", 8), ("7B", 16), ("7B", 32), ("70B", 2), ("70B", 20), ("70B", 40),
         ("70B", 80)]
QUICK = [("7B", 2), ("7B", 8), ("7B", 32), ("70B", 80)]
STATIC = [("7B", 32), ("70B", 80)]  # also planned as plan_model / explain(dynamic=False) do
GOALS_S = {("7B", 32): 5.0, ("70B", 80): 30.0}
GOAL_RSS_MB = 2048
REUSE = [("7B", 32), ("70B", 80), ("405B", 126)]
REUSE_GOALS_S = {("7B", 32): 3.0, ("70B", 80): 5.0, ("405B", 126): 10.0}


def _meta_llama(shape: str, layers: int, seq: int):
    from tpcompile.tools import models

    cfg = models.ModelConfig(**{"vocab": 32000, "n_layers": layers, "max_seq": seq,
                                "bias": False, **SHAPES[shape]})
    with torch.device("meta"):
        model = models.Llama(cfg)
    warm = models.build("mlp")  # pay torch.export's one-time imports outside the timings
    torch.export.export(warm, models.example_inputs(warm, 2, 8), strict=False)
    return model, torch.zeros(2, seq, dtype=torch.long, device="meta")


def measure_point(shape: str, layers: int, world_size: int, seq: int, dynamic: bool = True,
                  reuse: bool = False) -> dict:
    """One point, in this process: build on meta, capture, plan, rewrite rank 0."""
    from tpcompile.passes import pipeline

    model, tokens = _meta_llama(shape, layers, seq)
    planned = pipeline.plan(model, (tokens,), world_size, dynamic=dynamic, reuse_blocks=reuse)
    t0 = time.perf_counter()
    pipeline.rewrite(planned, 0, "tp")
    rewrite_s = time.perf_counter() - t0
    capture_s = planned.seconds["capture"]
    plan_s = planned.seconds["planning_passes"] + planned.seconds["plan_sharding"]
    nodes = len(planned.cap.gm.graph.nodes)
    return {"shape": shape, "layers": layers, "world_size": world_size, "seq": seq,
            "capture": ("dynamic" if dynamic else "static") + (", reused blocks" if reuse else ""),
            "nodes": nodes,
            "params": sum(p.numel() for p in model.parameters()),
            "capture_s": capture_s, "plan_s": plan_s, "rewrite_s": rewrite_s,
            "total_s": capture_s + plan_s + rewrite_s,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


EXPORT_MODES = {  # --breakdown: label -> (dynamic dims, FX stack traces)
    "dynamic + stack traces (before)": (True, True),
    "dynamic (as shipped)": (True, False),
    "static shapes": (False, False),
}


def measure_export(shape: str, layers: int, seq: int, mode: str) -> dict:
    """torch.export alone, as tpcompile calls it, in one of ``EXPORT_MODES``."""
    from tpcompile.core.capture import _export  # the call capture() makes, to time it alone

    model, tokens = _meta_llama(shape, layers, seq)
    dynamic, stack_traces = EXPORT_MODES[mode]
    t0 = time.perf_counter()
    ep = _export(model, (tokens,), {}, dynamic, (), stack_traces)
    return {"mode": mode, "shape": shape, "layers": layers, "export_s": time.perf_counter() - t0,
            "nodes": len(ep.graph.nodes),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _in_subprocess(call: str, module: str = "planning") -> dict:
    """``bench.<module>.<call>``'s dict, computed in a fresh Python process."""
    code = f"import json; from bench import {module}; print(json.dumps({module}.{call}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``; returns (a, b, worst |residual| / y)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(y - (a + b * x)) / y for x, y in zip(xs, ys))


def markdown(rows: list[dict], reuse_goals: bool = False) -> str:
    lines = ["| shape | layers | capture | parameters | graph nodes | capture s | plan s "
             "| rewrite s | total s | ms / node | peak RSS MB | goal |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        goals = REUSE_GOALS_S if reuse_goals else GOALS_S
        goal = goals.get((r["shape"], r["layers"]))
        verdict = "" if goal is None else (
            f"< {goal:.0f} s: {'met' if r['total_s'] < goal else 'missed'}")
        lines.append(
            f"| {r['shape']} | {r['layers']} | {r['capture']} | {r['params'] / 1e9:.2f}B | {r['nodes']:,} | "
            f"{r['capture_s']:.2f} | {r['plan_s']:.2f} | {r['rewrite_s']:.2f} | "
            f"{r['total_s']:.2f} | {1e3 * r['total_s'] / r['nodes']:.2f} | "
            f"{r['peak_rss_mb']:.0f} | {verdict} |")
    return "\n".join(lines)


def growth(rows: list[dict]) -> str:
    """Per shape: the linear fit over nodes, and the per-node cost at both ends."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        pts = [r for r in rows if r["shape"] == shape and r["capture"] == "dynamic"]
        if len(pts) < 2:
            continue
        a, b, worst = linear_fit([r["nodes"] for r in pts], [r["total_s"] for r in pts])
        lo, hi = pts[0], pts[-1]
        out.append(f"{shape}: total = {a:.2f} s + {1e3 * b:.2f} ms x nodes (worst residual "
                   f"{worst:.0%}); {1e3 * lo['total_s'] / lo['nodes']:.2f} ms/node at "
                   f"{lo['layers']} layers, {1e3 * hi['total_s'] / hi['nodes']:.2f} at "
                   f"{hi['layers']}")
    return "\n".join(out)


def breakdown_markdown(rows: list[dict]) -> str:
    base = rows[0]["export_s"]
    lines = ["| torch.export of the 7B shape, 32 layers | seconds | vs before | peak RSS MB |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['mode']} | {r['export_s']:.2f} | {r['export_s'] / base:.2f}x | "
              f"{r['peak_rss_mb']:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 points instead of 8")
    p.add_argument("--breakdown", action="store_true",
                   help="torch.export of the 7B shape: with / without stack traces, static")
    p.add_argument("--reuse", action="store_true",
                   help="7B / 70B / 405B shapes: whole export (before) vs reuse_blocks (after)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", help="results file stem (default: planning, planning-breakdown)")
    args = p.parse_args(argv)
    out = args.out or ("planning-breakdown" if args.breakdown else
                       "planning-reuse" if args.reuse else "planning")
    rows = []
    if args.reuse:
        for shape, layers in REUSE:
            for reuse in (False, True):
                rows.append(_in_subprocess(f"measure_point({shape!r}, {layers}, {args.world_size}, "
                                           f"{args.seq}, True, {reuse})"))
                print(f"  {shape} {layers} layers ({rows[-1]['capture']}): "
                      f"{rows[-1]['total_s']:.2f} s, {rows[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr)
        table, summary = markdown(rows, reuse_goals=True), ""
    elif args.breakdown:  # modes interleaved, 3 rounds, median per mode
        runs = {mode: [] for mode in EXPORT_MODES}
        for _ in range(3):
            for mode in EXPORT_MODES:
                runs[mode].append(_in_subprocess(f"measure_export('7B', 32, {args.seq}, {mode!r})"))
                print(f"  {mode}: {runs[mode][-1]['export_s']:.2f} s", file=sys.stderr)
        rows = [{**r[0], "export_s": statistics.median(x["export_s"] for x in r),
                 "runs_s": [x["export_s"] for x in r]} for r in runs.values()]
        table, summary = breakdown_markdown(rows), ""
    else:
        points = [(s, n, True) for s, n in (QUICK if args.quick else SWEEP)]
        for shape, layers, dynamic in points + [(s, n, False) for s, n in STATIC]:
            rows.append(_in_subprocess(
                f"measure_point({shape!r}, {layers}, {args.world_size}, {args.seq}, {dynamic})"))
            print(f"  {shape} {layers} layers ({rows[-1]['capture']}): {rows[-1]['total_s']:.2f} s, "
                  f"{rows[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr)
        table, summary = markdown(rows), growth(rows)
    RESULTS.mkdir(exist_ok=True)
    result = {"torch": torch.__version__, "world_size": args.world_size, "seq": args.seq,
              "rows": rows, "growth": summary}
    (RESULTS / f"{out}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{out}.md").write_text(table + ("\n\n" + summary if summary else "") + "\n")
    print(table)
    if summary:
        print("\n" + summary)
    return result


if __name__ == "__main__":
    main()
