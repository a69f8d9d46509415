"""Time to the first compiled training step vs model depth: tpcompile and DTensor side by side.

    python -m bench.compile_time --world-size 2 --model llama --layers 2,16 --repeats 2

For every depth, every variant builds the same model and times, cold (``torch._dynamo.reset``
and ``fresh_inductor_cache``), from the model to the end of its first compiled forward +
backward: parallelize (or ``parallelize_module``), ``torch.compile``, the first step (the
backend: its first two, since it shards on the first and compiles on the second). Variants:

    dtensor compiled            torch.compile(parallelize_module(model, torchtitan plan))
    tpcompile compiled          ``tp.compiled_blocks = True`` and torch.compile(tp,
                                fullgraph=True, options=compile_options(compiled_blocks=True)):
                                repeated blocks as one compiled block
                                (tpcompile/runtime/compiled_blocks.py)
    tpcompile compiled (flat)   torch.compile(tp, fullgraph=True): the whole graph (default)
    tpcompile backend           torch.compile(model, backend=tpcompile.backend()): compiled blocks

Where the time goes comes from Dynamo's own timers (``torch._dynamo.utils.
compilation_time_metrics``, the table ``torch._dynamo.utils.compile_times()`` prints), per
phase: Dynamo's bytecode tracing, AOT autograd's joint trace and partition, inductor's
forward/backward compile, and inside those the C++ compiler (``compile_file``). Rounds
repeat every (depth, variant) in a new shuffled order, so load on a shared machine falls on
all alike; a time is the slowest rank's; the table shows the median and the min-max.
Writes bench/results/compile-<model>-ws<N>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench import baselines
import tpcompile
from tpcompile.tools import models
from tpcompile.tools.numerics import rel_err

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("dtensor compiled", "tpcompile compiled", "tpcompile compiled (flat)",
            "tpcompile backend")
# Dynamo's timer names -> the phase they measure (inductor's include its C++ compile)
PHASES = {"dynamo trace": "bytecode_tracing",
          "aot joint trace": "aot_trace_joint_graph",
          "aot partition": "min_cut_rematerialization_partition",
          "inductor forward": "compile_fx.<locals>.fw_compiler_base",
          "inductor backward": "compile_fx.<locals>.bw_compiler",
          "  lowering": "GraphLowering.run",
          "  scheduling + codegen": "GraphLowering.codegen",
          "  C++ compile": "compile_file"}
SIZES = dict(dim=256, n_heads=8, n_kv_heads=4, hidden=768, vocab=512, max_seq=128)


def _setup(name: str, model, inputs, mesh):
    """``(callable, calls to its first compiled step)`` for one variant."""
    if name == "dtensor compiled":
        return torch.compile(baselines.parallelize_dtensor(model, mesh)), 1
    if name == "tpcompile backend":
        return torch.compile(model, backend=tpcompile.backend(mesh=mesh)), 2
    tp = tpcompile.parallelize(model, inputs, mesh)
    tp.compiled_blocks = name == "tpcompile compiled"
    options = tpcompile.compile_options(compiled_blocks=tp.compiled_blocks)
    return torch.compile(tp, fullgraph=True, options=options), 1


def _one(name: str, layers: int, cfg, mesh) -> dict:
    """Time one variant at one depth from a fresh model and empty compile caches."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch._inductor.utils import fresh_inductor_cache

    torch._dynamo.reset()
    compilation_time_metrics.clear()
    counters.clear()
    model = models.build(cfg.model, n_layers=layers, **SIZES)
    inputs = models.example_inputs(model, cfg.batch, cfg.seq)
    reference = model(*inputs).detach()
    with fresh_inductor_cache():
        dist.barrier()
        start = time.perf_counter()
        step, calls = _setup(name, model, inputs, mesh)
        setup = time.perf_counter() - start
        for _ in range(calls):
            out = step(*inputs)
            out.float().pow(2).mean().backward()
        first = time.perf_counter() - start
    phases = {k: sum(compilation_time_metrics.get(v, [])) for k, v in PHASES.items()}
    return {"setup_s": setup, "first_step_s": first, "phases": phases,
            "graphs": counters["stats"]["unique_graphs"], "err": rel_err(out.detach(), reference)}


def rank_main(rank: int, world_size: int, config: dict) -> list:
    from torch._inductor.utils import fresh_inductor_cache
    from torch.distributed.device_mesh import init_device_mesh

    cfg = argparse.Namespace(**config)
    mesh = init_device_mesh("cpu", (world_size,))
    with fresh_inductor_cache():  # pay inductor's one-time imports before timing any compile
        warm = torch.randn(4, 4, requires_grad=True)
        torch.compile(lambda x: (x * 2).sum())(warm).backward()
    order, rows = random.Random(0), []  # the same shuffled order on every rank
    for round_ in range(cfg.repeats):
        cases = [(n, layers) for layers in cfg.layers for n in cfg.variants]
        for name, layers in order.sample(cases, len(cases)):
            rows.append({"variant": name, "layers": layers, "round": round_,
                         **_one(name, layers, cfg, mesh)})
    return rows


def summarize(per_rank: list[list]) -> list[dict]:
    """Per (variant, depth): median and range over rounds of the slowest rank's times."""
    groups: dict = {}
    for rows in zip(*per_rank):
        r0 = rows[0]
        slowest = max(rows, key=lambda r: r["first_step_s"])
        groups.setdefault((r0["variant"], r0["layers"]), []).append(
            {**slowest, "err": max(r["err"] for r in rows)})
    out = []
    for (name, layers), runs in groups.items():
        first = [r["first_step_s"] for r in runs]
        out.append({"variant": name, "layers": layers, "runs": len(runs),
                    "first_step_s": statistics.median(first), "min_s": min(first),
                    "max_s": max(first),
                    "setup_s": statistics.median(r["setup_s"] for r in runs),
                    "phases": {k: statistics.median(r["phases"][k] for r in runs)
                               for k in PHASES},
                    "graphs": runs[0]["graphs"], "max_err": max(r["err"] for r in runs)})
    return sorted(out, key=lambda s: (s["layers"], VARIANTS.index(s["variant"])))


def tables(summary: list[dict], depths: list[int]) -> str:
    """The depth curve (time to first step per variant and depth) and the phase breakdown."""
    names = [n for n in VARIANTS if any(s["variant"] == n for s in summary)]
    at = {(s["variant"], s["layers"]): s for s in summary}
    head = "| variant | " + " | ".join(f"{d} layers s (min-max)" for d in depths)
    head += f" | {depths[-1]} / {depths[0]} layers |" if len(depths) > 1 else " |"
    rows = [head, "|---|" + "---:|" * (len(depths) + (len(depths) > 1))]
    for n in names:
        cells = [f"{at[n, d]['first_step_s']:.1f} ({at[n, d]['min_s']:.1f}-{at[n, d]['max_s']:.1f})"
                 for d in depths]
        if len(depths) > 1:
            cells.append(f"{at[n, depths[-1]]['first_step_s'] / at[n, depths[0]]['first_step_s']:.2f}x")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    rows += ["", "| variant | layers | setup s | " + " | ".join(PHASES) + " | graphs | max rel err |",
             "|---|---:|---:|" + "---:|" * (len(PHASES) + 2)]
    for s in summary:
        rows.append(f"| {s['variant']} | {s['layers']} | {s['setup_s']:.1f} | "
                    + " | ".join(f"{s['phases'][k]:.1f}" for k in PHASES)
                    + f" | {s['graphs']} | {s['max_err']:.1e} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", default="llama")
    p.add_argument("--layers", default="2,16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    cfg = {"model": args.model, "batch": args.batch, "seq": args.seq, "repeats": args.repeats,
           "layers": [int(d) for d in args.layers.split(",")],
           "variants": [v.strip() for v in args.variants.split(",") if v.strip()]}
    unknown = set(cfg["variants"]) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    from tpcompile.tools.launch import run_on_ranks

    load = os.getloadavg()
    per_rank = run_on_ranks(f"{Path(__file__).resolve()}:rank_main", args.world_size, cfg,
                            timeout=7200)
    summary = summarize(per_rank)
    print(f"{args.model}, {args.world_size} gloo ranks, batch {args.batch}, seq {args.seq}, "
          f"{args.repeats} rounds; time from the model to the end of its first compiled step\n")
    print(tables(summary, cfg["layers"]))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"compile-{args.model}-ws{args.world_size}.json"
    path.write_text(json.dumps({"config": cfg, "torch": torch.__version__, "cpus": os.cpu_count(),
                                "loadavg_before_after": (load, os.getloadavg()),
                                "summary": summary, "raw": per_rank}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
