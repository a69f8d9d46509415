"""What the per-call checks cost: eager step time with each check mode against the bare graph.

    python -m bench.call_check [--world-size 2] [--steps 300] [--seq 16]

On gloo ranks (tpcompile.tools.launch), the built-in Llama (dim 64, 2 layers, 2 x 16 tokens by
default) is parallelized twice, ``check_calls="new"`` and ``"every"``; three variants run a
training step (forward, ``sum``, backward) side by side:

    graph      tp.graph_module(ids): the rewritten graph with no check at all
    new        tp(ids), check_calls="new": local input checks (structure, limits, one aminmax of
               the ids) and a dict lookup of the call's description
    every      tp(ids), check_calls="every": the same plus one 16-byte gloo all-reduce per call

Then the check alone is timed per call (``tp.call_check``, no step around it). Steps are
interleaved round-robin in a shuffled order (a noisy machine slows all alike); a
step's time is the slowest rank's; the table gives medians and the overhead against "graph".
Writes bench/results/call_check-ws<N>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("graph", "new", "every")


def _ranks(rank: int, world_size: int, steps: int, seq: int) -> dict:
    import torch.distributed as dist

    import tpcompile
    from tpcompile.tools import models

    model = models.build("llama")
    (ids,) = models.example_inputs(model, seq=seq)
    tps = {m: tpcompile.parallelize(model, (ids,), check_calls=m) for m in ("new", "every")}
    run = {"graph": tps["new"].graph_module, "new": tps["new"], "every": tps["every"]}
    times = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    rng = random.Random(0)  # the same shuffle on every rank: the same collectives in order
    for i in range(steps + 5):
        rng.shuffle(order)
        for v in order:
            dist.barrier()
            start = time.perf_counter()
            run[v](ids).sum().backward()
            if i >= 5:  # warm-up
                times[v].append(time.perf_counter() - start)
    checks = {}  # the check alone, per call, without the step around it
    for m, tp in tps.items():
        ts = []
        for _ in range(steps):
            start = time.perf_counter()
            tp.call_check(tp.input_spec, (ids,), {})
            ts.append(time.perf_counter() - start)
        checks[m] = statistics.median(ts)
    every = [None] * world_size
    dist.all_gather_object(every, (times, checks))
    return {**{v: [max(r[0][v][i] for r in every) for i in range(steps)] for v in VARIANTS},
            "check_us": {m: max(r[1][m] for r in every) * 1e6 for m in checks}}


def main() -> None:
    from tpcompile.tools.launch import run_on_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=16)
    a = p.parse_args()
    slowest = run_on_ranks(f"{__file__}:_ranks", a.world_size, a.steps, a.seq)[0]
    med = {v: statistics.median(slowest[v]) * 1e3 for v in VARIANTS}
    print(f"Llama (built-in), {a.world_size} gloo ranks, 2 x {a.seq} tokens, median of {a.steps} "
          "fwd+bwd steps (slowest rank)\n\n| variant | step ms | vs graph |\n|---|---:|---:|")
    for v in VARIANTS:
        print(f"| {v} | {med[v]:.3f} | {med[v] - med['graph']:+.3f} ms "
              f"({(med[v] / med['graph'] - 1) * 100:+.1f}%) |")
    print("\nthe check alone, median per call (slowest rank): " + ", ".join(
        f"{m}: {us:.1f} us" for m, us in slowest["check_us"].items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"call_check-ws{a.world_size}.json").write_text(json.dumps(
        {"world_size": a.world_size, "seq": a.seq, "steps": a.steps, "median_ms": med, "check_us": slowest["check_us"],
         "step_ms": {v: [t * 1e3 for t in slowest[v]] for v in VARIANTS}}, indent=1))


if __name__ == "__main__":
    main()
