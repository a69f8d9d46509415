"""Every benchmark, one command: bench/results/*.json and one markdown summary.

    python -m bench.run_all             # about 45 minutes on 2 shared cores
    python -m bench.run_all --quick     # eager step times only, 5 steps, short planning sweep

Sections, each its own script (run alone for details and options):

1. step time (``step_time.py``): tpcompile vs ``parallelize_module`` with the torchtitan-style
   plan, Llama and GPT-2, 2 and 4 gloo ranks, eager and compiled, and the ideal, with each
   variant's time to first step (parallelize + compile + first step);
   time to the first compiled step vs depth (``compile_time.py``, full run only): tpcompile
   and DTensor at 2 and 16 layers, and where the compile time goes;
2. communication (``communication.py``): collectives and bytes per step vs Megatron's bound;
3. planning scale (``planning.py``): capture + plan + rewrite of 7B / 70B Llama shapes on meta;
4. memory (``memory.py --vs-ideal``): parameter bytes per rank vs sharded / N + replicated.

The GPU checks are ``bench/gpu.sh`` (not run here: they need a CUDA device). Each section runs
in its own process, one after the other (never two at once: they would time each other). The
summary goes to ``bench/results/summary.md``; ``summary.json`` records the commands, their
durations, the load average around each and the result files they wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FULL_VARIANTS = "dtensor eager,dtensor compiled,tpcompile eager,tpcompile compiled,unsharded"
QUICK_VARIANTS = "dtensor eager,tpcompile eager,unsharded"


def sections(quick: bool) -> list[tuple[str, list[str]]]:
    variants, steps = (QUICK_VARIANTS, "5") if quick else (FULL_VARIANTS, "10")
    out = [(f"step time: {model}, {ws} ranks",
            ["bench.step_time", "--model", model, "--world-size", str(ws), "--steps", steps,
             "--only", variants])
           for model in ("llama", "gpt2") for ws in (2, 4)]
    if not quick:
        out.append(("time to first compiled step vs depth: llama, 2 ranks",
                    ["bench.compile_time", "--model", "llama", "--layers", "2,16",
                     "--repeats", "2"]))
    out += [("communication vs Megatron's bound", ["bench.communication"]),
            ("planning scale", ["bench.planning"] + (["--quick", "--out", "planning-quick"]
                                                     if quick else [])),
            ("parameter memory vs the ideal", ["bench.memory", "--vs-ideal"])]
    return out


def _table(stdout: str) -> str:
    """The markdown lines of a script's output (tables and the lines right after them)."""
    return "\n".join(line for line in stdout.splitlines()
                     if line.startswith("|") or line.split(":")[0] in ("7B", "70B"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    record, parts = [], [f"# tpcompile benchmarks ({'quick' if args.quick else 'full'})\n"]
    for title, command in sections(args.quick):
        before, start = os.getloadavg(), time.perf_counter()
        print(f"== {title}: {' '.join(command)}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True,
                              cwd=HERE.parent)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{title} failed (exit {done.returncode})")
        seconds = time.perf_counter() - start
        record.append({"section": title, "command": command, "seconds": seconds,
                       "loadavg_before_after": [before, os.getloadavg()]})
        parts.append(f"## {title}\n\n{_table(done.stdout)}\n")
    written = sorted(str(f.relative_to(HERE)) for f in RESULTS.glob("*.json"))
    (RESULTS / "summary.json").write_text(json.dumps(
        {"quick": args.quick, "cpus": os.cpu_count(), "sections": record, "files": written},
        indent=1))
    (RESULTS / "summary.md").write_text("\n".join(parts))
    print("\n".join(parts))


if __name__ == "__main__":
    main()
