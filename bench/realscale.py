"""Real scale: planning Hugging Face Llama-3 configs at 8 ranks on meta, as users call it.

    python -m bench.realscale             # -> results/realscale-<date>.md, .json
    python -m bench.realscale --profile   # also cProfile's top functions of the 8B plan
    python -m bench.realscale --reused-only   # the default path only -> realscale-<date>-reused
    python -m bench.realscale --all   # the default path, then issue #47's items 2-4, judged
                                      # (bench/realscale_workloads.py) -> realscale-<date>-all

``tpcompile.plan_model`` (its defaults: dynamic batch and sequence, block reuse) of
``transformers.LlamaForCausalLM`` built on the meta device with the Llama-3 8B (32 layers),
70B (80) and 405B (126) shapes (vocabulary 128256, 8 KV heads), 2 x 2048 token ids, world
size 8; the 8B and 70B also with ``reuse_blocks=False`` (every block exported), and the 8B
shape at 4 to 64 layers: planning time against depth. Each point is a fresh process (its own
peak RSS, no cache carried over); torch.export's one-time imports are paid before the clock.

A point's seconds split into *export* (torch.export, the calls tpcompile makes) and the
*rest* (stamping the other blocks, prepare passes, propagation, the frozen plan).
Issue #47's targets: 8B <= 2.5 s, 70B <= 5 s, 405B <= 8 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import time

import torch

from bench.planning import RESULTS, _in_subprocess

LLAMA3 = {
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64),
    "405B": dict(hidden_size=16384, intermediate_size=53248, num_attention_heads=128),
}
DEPTH = {"8B": 32, "70B": 80, "405B": 126}
TARGETS_S = {("8B", 32): 2.5, ("70B", 80): 5.0, ("405B", 126): 8.0}
POINTS = [("8B", 32, False), ("8B", 32, True), ("70B", 80, False), ("70B", 80, True),
          ("405B", 126, True)] + [("8B", n, True) for n in (4, 8, 16, 64)]


def _meta_llama3(shape: str, layers: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128256, num_hidden_layers=layers,
                                   num_key_value_heads=8, max_position_embeddings=131072,
                                   rope_theta=500000.0, **LLAMA3[shape])
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def measure(shape: str, layers: int, world_size: int, seq: int, reuse: bool) -> dict:
    """One point, in this process: build on meta, then ``plan_model`` timed part by part."""
    from tpcompile import api
    from tpcompile.core import capture

    model = _meta_llama3(shape, layers)
    warm = torch.nn.Linear(4, 4)  # torch.export's one-time imports, outside the timings
    torch.export.export(warm, (torch.randn(2, 4),), strict=False)
    exported, export = [0.0], capture._export

    def timed_export(*args, **kwargs):
        t = time.perf_counter()
        try:
            return export(*args, **kwargs)
        finally:
            exported[0] += time.perf_counter() - t

    capture._export = timed_export
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    cap, plan = api.plan_model(model, (ids,), world_size, reuse_blocks=reuse)
    total = time.perf_counter() - t0
    capture._export = export
    return {"shape": shape, "layers": layers, "reuse": reuse, "world_size": world_size,
            "nodes": len(cap.gm.graph.nodes), "total_s": total, "export_s": exported[0],
            "notes": list(plan.notes),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | layers | capture | graph nodes | plan_model s | export s | rest s "
             "| peak RSS MB | target |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        goal = TARGETS_S.get((r["shape"], r["layers"])) if r["reuse"] else None
        verdict = "" if goal is None else (
            f"<= {goal:g} s: {'met' if r['total_s'] <= goal else 'missed'}")
        lines.append(f"| Llama-3 {r['shape']} | {r['layers']} | "
                     f"{'reused blocks (default)' if r['reuse'] else 'every block exported'} | "
                     f"{r['nodes']:,} | {r['total_s']:.2f} | {r['export_s']:.2f} | "
                     f"{r['total_s'] - r['export_s']:.2f} | {r['peak_rss_mb']:.0f} | {verdict} |")
    return "\n".join(lines)


def profile(shape: str = "8B", seq: int = 2048, top: int = 25) -> str:
    """cProfile of one default ``plan_model`` of ``shape``: the functions that take its time."""
    import cProfile
    import io
    import pstats

    from tpcompile import api

    model = _meta_llama3(shape, DEPTH[shape])
    torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), strict=False)
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    prof = cProfile.Profile()
    prof.runcall(api.plan_model, model, (ids,), 8)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--profile", action="store_true", help="cProfile the 8B plan too")
    p.add_argument("--reused-only", action="store_true",
                   help="only the default (reused blocks) points: a minute, not several")
    p.add_argument("--all", action="store_true",
                   help="the default points, then a checkpoint to first token, the step at "
                        "real width and compile against depth (bench/realscale_workloads.py)")
    p.add_argument("--dir", default="/tmp/tpcompile-llama-1b",
                   help="--all: where the 1B checkpoint is saved once and read")
    args = p.parse_args(argv)
    load = os.getloadavg()
    rows = []
    for shape, layers, reuse in [pt for pt in POINTS if pt[2] or not (args.reused_only or args.all)]:
        rows.append(_in_subprocess(f"measure({shape!r}, {layers}, {args.world_size}, "
                                   f"{args.seq}, {reuse})", module="realscale"))
        print(f"  {shape} {layers} layers reuse={reuse}: {rows[-1]['total_s']:.2f} s",
              file=sys.stderr)
    date = datetime.date.today().isoformat()
    result = {"date": date, "torch": torch.__version__, "load_before": load,
              "load_after": os.getloadavg(), "world_size": args.world_size, "seq": args.seq,
              "rows": rows}
    text = (f"{date}, torch {torch.__version__}, load average {load[0]:.1f} before, "
            f"{result['load_after'][0]:.1f} after; world size {args.world_size}, 2 x "
            f"{args.seq} tokens\n\n" + markdown(rows) + "\n")
    if args.all:
        from bench import realscale_workloads

        result["workloads"] = realscale_workloads.judged(args.dir)
        text += "\n" + realscale_workloads.markdown(result["workloads"]) + "\n"
        result["load_end"] = os.getloadavg()  # load_after: when the planning points ended
        text += f"\nload average {result['load_end'][0]:.1f} at the end\n"
    if args.profile:
        result["profile"] = _in_subprocess("profile()", module="realscale")
        text += "\n```\n" + result["profile"] + "```\n"
    RESULTS.mkdir(exist_ok=True)
    stem = f"realscale-{date}" + ("-all" if args.all else "-reused" if args.reused_only else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
