"""Planning scale: capture + plan + rewrite time and peak memory of Llama-shaped models on meta.

    python bench/planning.py                     # the sweep: markdown table, JSON in results/
    python bench/planning.py --quick             # a shorter sweep (a minute on 2 cores)
    python bench/planning.py --breakdown         # where a 7B capture's time goes

Each point runs in a fresh subprocess, so its peak resident memory (``ru_maxrss``) is its own
and no cache (fake-tensor, sympy, linecache) carries over from a smaller model. A point is what
one rank of ``parallelize`` does before its first collective: ``capture`` (torch.export with
dynamic batch and sequence dims), ``plan`` (split biases, propagate placements, freeze the
plan) and ``rewrite`` (the rank-0 pass pipeline: local shapes, collectives, shards on meta).
The weights are never allocated.

Two shapes, as in the Llama 2 papers: *7B* (hidden 4096, 32 query / 32 KV heads would be
Llama 2; here 8 KV heads as in the other benchmarks, SwiGLU 11008) and *70B* (hidden 8192, 64
query / 8 KV heads, SwiGLU 28672), both vocabulary 32000, 2 x 2048 tokens, world size 8.
Growth is judged per captured graph node: seconds per node at the smallest and the largest
point, and a least-squares line ``seconds = a + b * nodes`` with its worst relative residual.

``--breakdown`` re-captures the 7B shape three ways (as shipped; without FX stack traces;
with static shapes) to show what the dynamic dims and the stack traces cost.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "7B": dict(dim=4096, n_heads=32, n_kv_heads=8, hidden=11008),
    "70B": dict(dim=8192, n_heads=64, n_kv_heads=8, hidden=28672),
}
SWEEP = [("7B", 2), ("7B", 8), ("7B", 16), ("7B", 32), ("70B", 2), ("70B", 20), ("70B", 40),
         ("70B", 80)]
QUICK = [("7B", 2), ("7B", 8), ("7B", 32), ("70B", 80)]
GOALS_S = {("7B", 32): 5.0, ("70B", 80): 30.0}
GOAL_RSS_MB = 2048


def measure_point(shape: str, layers: int, world_size: int, seq: int, capture_mode: str) -> dict:
    """One point, in this process: build on meta, capture, plan, rewrite rank 0."""
    import torch.fx.config as fx_config

    from tpcompile import models
    from tpcompile.api import rewrite_passes
    from tpcompile.capture import capture
    from tpcompile.passes.bias import split_bias_pass
    from tpcompile.passes.plan_sharding import plan_sharding
    from tpcompile.pipeline import run_passes
    from tpcompile.plan import PlanOptions

    cfg = models.ModelConfig(vocab=32000, n_layers=layers, max_seq=seq, bias=False,
                             **SHAPES[shape])
    with torch.device("meta"):
        model = models.Llama(cfg)
    tokens = torch.zeros(2, seq, dtype=torch.long, device="meta")
    warm = models.build("mlp")  # pay torch.export's one-time imports outside the timings
    capture(warm, models.example_inputs(warm, 2, 8))
    fx_config.do_not_emit_stack_traces = capture_mode == "no stack traces"
    t0 = time.perf_counter()
    cap = capture(model, (tokens,), dynamic=capture_mode != "static shapes")
    t1 = time.perf_counter()
    split_bias_pass(cap.gm)
    plan = plan_sharding(cap, world_size, PlanOptions())
    t2 = time.perf_counter()
    nodes = len(cap.gm.graph.nodes)
    run_passes(cap.gm, rewrite_passes(plan, 0, "tp"))
    t3 = time.perf_counter()
    return {"shape": shape, "layers": layers, "world_size": world_size, "seq": seq,
            "capture_mode": capture_mode, "nodes": nodes,
            "params": sum(p.numel() for p in model.parameters()),
            "capture_s": t1 - t0, "plan_s": t2 - t1, "rewrite_s": t3 - t2, "total_s": t3 - t0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _in_subprocess(shape: str, layers: int, world_size: int, seq: int, mode: str) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import planning; print(json.dumps(planning.measure_point("
            f"{shape!r}, {layers}, {world_size}, {seq}, {mode!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``; returns (a, b, worst |residual| / y)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(y - (a + b * x)) / y for x, y in zip(xs, ys))


def markdown(rows: list[dict], first: str = "shape") -> str:
    """One row per point; ``first``: the row label ('shape', or 'capture_mode' for --breakdown)."""
    lines = [f"| {first.replace('_', ' ')} | layers | parameters | graph nodes | capture s | plan s | rewrite s "
             "| total s | ms / node | peak RSS MB | goal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        goal = GOALS_S.get((r["shape"], r["layers"]))
        verdict = "" if goal is None else (
            f"< {goal:.0f} s: {'met' if r['total_s'] < goal else 'missed'}")
        lines.append(
            f"| {r[first]} | {r['layers']} | {r['params'] / 1e9:.2f}B | {r['nodes']:,} | "
            f"{r['capture_s']:.2f} | {r['plan_s']:.2f} | {r['rewrite_s']:.2f} | "
            f"{r['total_s']:.2f} | {1e3 * r['total_s'] / r['nodes']:.2f} | "
            f"{r['peak_rss_mb']:.0f} | {verdict} |")
    return "\n".join(lines)


def growth(rows: list[dict]) -> str:
    """Per shape: the linear fit over nodes, and the per-node cost at both ends."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        pts = [r for r in rows if r["shape"] == shape]
        if len(pts) < 2:
            continue
        a, b, worst = linear_fit([r["nodes"] for r in pts], [r["total_s"] for r in pts])
        lo, hi = pts[0], pts[-1]
        out.append(f"{shape}: total = {a:.2f} s + {1e3 * b:.2f} ms x nodes (worst residual "
                   f"{worst:.0%}); {1e3 * lo['total_s'] / lo['nodes']:.2f} ms/node at "
                   f"{lo['layers']} layers, {1e3 * hi['total_s'] / hi['nodes']:.2f} at "
                   f"{hi['layers']}")
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 points instead of 8")
    p.add_argument("--breakdown", action="store_true",
                   help="7B at 32 layers: as shipped, without stack traces, static shapes")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", default="planning")
    args = p.parse_args(argv)
    if args.breakdown:
        points = [("7B", 32, mode) for mode in ("dynamic", "no stack traces", "static shapes")]
    else:
        points = [(s, n, "dynamic") for s, n in (QUICK if args.quick else SWEEP)]
    rows = []
    for shape, layers, mode in points:
        rows.append(_in_subprocess(shape, layers, args.world_size, args.seq, mode))
        r = rows[-1]
        print(f"  {shape} {layers} layers ({mode}): {r['total_s']:.2f} s, "
              f"{r['peak_rss_mb']:.0f} MB", file=sys.stderr)
    table = markdown(rows, "capture_mode" if args.breakdown else "shape")
    summary = growth(rows) if not args.breakdown else ""
    RESULTS.mkdir(exist_ok=True)
    result = {"torch": torch.__version__, "world_size": args.world_size, "seq": args.seq,
              "rows": rows, "growth": summary}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{args.out}.md").write_text(table + ("\n\n" + summary if summary else "") + "\n")
    print(table)
    if summary:
        print("\n" + summary)
    return result


if __name__ == "__main__":
    main()
