"""Expert-TP against whole experts on a transformers grouped-matmul MoE block, on gloo ranks.

    python -m bench.experts     # 2 shapes x 2 and 4 ranks -> results/experts-<date>.md, .json

One Qwen3-MoE sparse block (router, top-k, experts run by transformers' grouped matmul),
model width 512, 512 tokens a step (batch 2 x 256), float32, random init: fine-grained (64
experts 256 wide, top-8) and coarse (8 experts 1024 wide, top-2), each parallelized with
``experts="tensor"`` and ``"expert"``, both built in each rank process and stepped in turn
(forward + backward of a fixed random projection of the output), the order alternating per
round, so load from other jobs on a shared machine falls on both. Per row: each cut's median
step time (the slowest rank's per round) with its quartiles; the expert weights' bytes on the
largest rank; the collectives one step issues; the cost model's estimate for both cuts
(``passes/planner/experts/cost.py``, CPU constants); the median per-round difference, whose
sign is the measured faster cut, and the half-width of its 95% interval (``1.57 x IQR /
sqrt(rounds)``, a box plot's notch), the spread; what
``experts="auto"`` plans, and whether that is the faster cut (``tie`` where the margin is
within the spread). tests/unit/test_expert_cost.py reads the newest JSON and asserts auto
picks the faster cut in every row decided beyond the spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

import tpcompile
from tpcompile.passes.planner.devices import DEVICES
from tpcompile.passes.planner.experts.cost import expert_costs
from tpcompile.tools.launch import run_on_ranks
from zoo.moe_blocks import moe_block

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"fine": (64, 256, 8), "coarse": (8, 1024, 2)}  # name -> (experts, width, top-k)
MODEL_WIDTH, BATCH, SEQ = 512, 2, 256
MODES = ("tensor", "expert")


def block(shape: str):
    """The MoE block of ``shape``, its weights drawn like a trained model's scale."""
    torch.manual_seed(0)
    moe = moe_block(*SHAPES[shape], MODEL_WIDTH)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, MODEL_WIDTH ** -0.5)
    return moe


def inputs() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, MODEL_WIDTH, generator=torch.Generator().manual_seed(1))


def _rank(rank: int, world_size: int, shape: str, rounds: int) -> dict:
    """On each rank: both cuts built, then ``rounds`` rounds of one step of each, interleaved
    (the order alternating per round), so a burst of load from other jobs falls on both."""
    import torch.distributed as dist

    from tpcompile.runtime.collectives import count_collectives

    torch.set_num_threads(1)
    x = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cuts = {mode: tpcompile.parallelize(block(shape), (x,), experts=mode) for mode in MODES}
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    times = {mode: [] for mode in MODES}
    for i in range(rounds + 1):  # round 0 is a warm-up
        for mode in (MODES if i % 2 else MODES[::-1]):
            dist.barrier()
            start = time.perf_counter()
            (cuts[mode](x) * probe).sum().backward()
            times[mode].append(time.perf_counter() - start)
            cuts[mode].zero_grad()
    return {mode: {"step_s": times[mode][1:],
                   "expert_bytes": sum(p.numel() * p.element_size()
                                       for n, p in tp.named_parameters() if "experts" in n),
                   "collectives": count_collectives(tp.graph_module)}
            for mode, tp in cuts.items()}


def _auto_pick(shape: str, world_size: int) -> str:
    """What ``experts="auto"`` plans for the block (no process group)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, plan = tpcompile.plan_model(block(shape), (inputs(),), world_size, experts="auto")
    (how,) = plan.experts.values()
    return how.split(" parallel")[0]


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def measure(shape: str, world_size: int, rounds: int) -> dict:
    """One row: per cut the slowest rank's step time per round; the measured winner is the
    sign of the median per-round difference (expert - tensor), its spread the half-width of
    that median's 95% interval, ``1.57 x IQR / sqrt(rounds)`` (a box plot's notch)."""
    experts, width, top_k = SHAPES[shape]
    tokens = BATCH * SEQ
    model = expert_costs(experts, width, MODEL_WIDTH, tokens * top_k, world_size, DEVICES["cpu"],
                         tokens=tokens)
    per_rank = run_on_ranks("bench.experts:_rank", world_size, shape, rounds)
    steps = {m: [max(r[m]["step_s"][i] for r in per_rank) for i in range(rounds)] for m in MODES}
    q1, diff, q3 = _quartiles([e - t for t, e in zip(steps["tensor"], steps["expert"])])
    row = {"shape": shape, "experts": experts, "width": width, "top_k": top_k,
           "world_size": world_size, "rounds": rounds,
           "measured_winner": "expert" if diff < 0 else "tensor",
           "margin_ms": 1e3 * abs(diff),
           "spread_ms": 1e3 * 1.57 * (q3 - q1) / math.sqrt(rounds),
           "auto": _auto_pick(shape, world_size)}
    for m in MODES:
        lo, median, hi = _quartiles(steps[m])
        row[m] = {"step_ms": 1e3 * median, "q1_ms": 1e3 * lo, "q3_ms": 1e3 * hi,
                  "expert_mib": max(r[m]["expert_bytes"] for r in per_rank) / 2**20,
                  "collectives": per_rank[0][m]["collectives"],
                  "model_ms": 1e3 * model[m].seconds}
    return row


def _collectives(c: dict) -> str:
    return "; ".join(f"{phase}: " + ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
                     for phase, ops in sorted(c.items()) if ops)


def table(rows: list[dict]) -> str:
    head = ("| shape | ranks | tensor ms (q1-q3) | expert ms (q1-q3) | expert MiB / rank t / e "
            "| collectives per step (both) | model ms t / e | expert - tensor ms (+- 95%) "
            "| measured faster | auto picks | auto = faster |\n"
            + "|---" * 11 + "|\n")
    lines = []
    for r in rows:
        t, e = r["tensor"], r["expert"]
        decided = r["margin_ms"] > r["spread_ms"]
        agree = "yes" if r["auto"] == r["measured_winner"] else ("NO" if decided else "tie")
        lines.append(
            f"| {r['shape']} ({r['experts']} x {r['width']}, top-{r['top_k']}) "
            f"| {r['world_size']} "
            + "".join(f"| {c['step_ms']:.1f} ({c['q1_ms']:.0f}-{c['q3_ms']:.0f}) " for c in (t, e))
            + f"| {t['expert_mib']:.2f} / {e['expert_mib']:.2f} | {_collectives(t['collectives'])} "
            f"| {t['model_ms']:.1f} / {e['model_ms']:.1f} "
            f"| {'-' if r['measured_winner'] == 'expert' else '+'}{r['margin_ms']:.1f} "
            f"({r['spread_ms']:.1f}) | {r['measured_winner']}{'' if decided else ' (within)'} "
            f"| {r['auto']} | {agree} |")
    return head + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = [measure(shape, ws, args.rounds) for ws in args.ranks for shape in SHAPES]
    date = datetime.date.today().isoformat()
    text = (f"# Expert-TP against whole experts ({date})\n\n`python -m bench.experts "
            f"--rounds {args.rounds}` on {torch.__version__}, CPU gloo ranks, one thread each, "
            f"{os.cpu_count()} cores, load average {load:.1f} at the start and "
            f"{os.getloadavg()[0]:.1f} at the end.\n\n" + table(rows) + "\n")
    (RESULTS / f"experts-{date}.md").write_text(text)
    (RESULTS / f"experts-{date}.json").write_text(json.dumps(
        {"command": f"python -m bench.experts --rounds {args.rounds}", "torch": torch.__version__,
         "load_average": [load, os.getloadavg()[0]], "rows": rows}, indent=1, sort_keys=True))
    print(text)


if __name__ == "__main__":
    main()
