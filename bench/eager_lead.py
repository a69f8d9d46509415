"""tpcompile eager vs DTensor eager, run after run: is the lead steady, not just on average?

    python -m bench.eager_lead --runs 5        # Llama and GPT-2, 2 and 4 gloo ranks

Each run is a fresh ``bench/step_time.py`` launch (new processes, new process group) of the
two eager variants, their steps interleaved; a run's lead is DTensor's median fwd+bwd time
over tpcompile's. The table shows, per model and world size, the median lead and its min-max
over the runs: the issue's goal is a lead >= 1.3x in *every* run. Writes
bench/results/eager-lead.json with every run's step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict
from pathlib import Path

from bench import step_time
from tpcompile.tools.launch import run_on_ranks

VARIANTS = ("dtensor eager", "tpcompile eager")
GOAL = 1.3


def one_run(model: str, world_size: int, steps: int) -> dict:
    cfg = step_time.Config(model=model, world_size=world_size, steps=steps,
                           only=",".join(VARIANTS))
    per_rank = run_on_ranks(f"{Path(step_time.__file__).resolve()}:rank_main", world_size,
                            asdict(cfg), timeout=1800)
    summary = step_time.summarize(per_rank)
    return {v: summary[v]["step_ms"] for v in VARIANTS}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--models", default="llama,gpt2")
    p.add_argument("--world-sizes", default="2,4")
    args = p.parse_args(argv)
    configs = [(m, int(ws)) for m in args.models.split(",") for ws in args.world_sizes.split(",")]
    load = os.getloadavg()
    runs: dict = {f"{m}-ws{ws}": [] for m, ws in configs}
    for _ in range(args.runs):  # round-robin over configs: load drifts across all of them
        for m, ws in configs:
            runs[f"{m}-ws{ws}"].append(one_run(m, ws, args.steps))
    rows = ["| model | ranks | dtensor eager ms (median) | tpcompile eager ms (median) "
            f"| lead, median (min-max of {args.runs} runs) | runs >= {GOAL}x |",
            "|---|---:|---:|---:|---:|---:|"]
    for m, ws in configs:
        r = runs[f"{m}-ws{ws}"]
        leads = [x["dtensor eager"] / x["tpcompile eager"] for x in r]
        rows.append(f"| {m} | {ws} | {statistics.median(x['dtensor eager'] for x in r):.1f} | "
                    f"{statistics.median(x['tpcompile eager'] for x in r):.1f} | "
                    f"{statistics.median(leads):.2f}x ({min(leads):.2f}-{max(leads):.2f}) | "
                    f"{sum(lead >= GOAL for lead in leads)}/{len(leads)} |")
    print("\n".join(rows))
    out = step_time.RESULTS / "eager-lead.json"
    out.write_text(json.dumps({"runs": runs, "steps": args.steps, "cpus": os.cpu_count(),
                               "loadavg_before_after": (load, os.getloadavg())}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
