"""Expert-TP against whole experts on a transformers grouped-matmul MoE block, on gloo ranks.

    python -m bench.experts          # 2 shapes x 2 and 4 ranks x 2 cuts -> results/experts-<date>.md

One Qwen3-MoE sparse block (router, top-k, experts run by transformers' grouped matmul),
model width 512, 512 tokens a step (batch 2 x 256), float32, random init: fine-grained (64
experts 256 wide, top-8) and coarse (8 experts 1024 wide, top-2), each parallelized with
``experts="tensor"`` and ``"expert"``. Per row: the median step time (forward + backward of a
fixed random projection of the output) over a few steps after a warm-up, the slowest rank's;
the expert weights' bytes on the largest rank; the collectives one step issues; the cost
model's estimate for both cuts (``passes/planner/expert_cost.py``, CPU constants) and what
``experts="auto"`` plans. The last column says whether auto's pick is the measured winner.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
import warnings
from pathlib import Path

import torch

import tpcompile
from tpcompile.passes.planner.expert_cost import DEVICES, expert_costs
from tpcompile.tools.launch import run_on_ranks

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"fine": (64, 256, 8), "coarse": (8, 1024, 2)}  # name -> (experts, width, top-k)
MODEL_WIDTH, BATCH, SEQ = 512, 2, 256
MODES = ("tensor", "expert")


def block(shape: str):
    """The MoE block of ``shape``, its weights drawn like a trained model's scale."""
    import transformers as tf

    experts, width, top_k = SHAPES[shape]
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(hidden_size=MODEL_WIDTH, moe_intermediate_size=width,
                               num_experts=experts, num_experts_per_tok=top_k)
    # a model sets it from_pretrained / __init__ (transformers' default); a bare block needs it
    config._experts_implementation = "grouped_mm"
    moe = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, MODEL_WIDTH ** -0.5)
    return moe


def inputs() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, MODEL_WIDTH, generator=torch.Generator().manual_seed(1))


def _rank(rank: int, world_size: int, shape: str, mode: str, steps: int) -> dict:
    """On each rank: step times, expert bytes held, collectives per step."""
    import torch.distributed as dist

    from tpcompile.runtime.collectives import count_collectives

    torch.set_num_threads(1)
    x = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tpcompile.parallelize(block(shape), (x,), experts=mode)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        (tp(x) * probe).sum().backward()
        times.append(time.perf_counter() - start)
        tp.zero_grad()
    held = sum(p.numel() * p.element_size() for n, p in tp.named_parameters() if "experts" in n)
    return {"step_s": statistics.median(times[1:]), "expert_bytes": held,
            "collectives": count_collectives(tp.graph_module), "how": tp.plan.experts}


def _auto_pick(shape: str, world_size: int) -> str:
    """What ``experts="auto"`` plans for the block (no process group)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, plan = tpcompile.plan_model(block(shape), (inputs(),), world_size, experts="auto")
    (how,) = plan.experts.values()
    return how.split(" parallel")[0]


def measure(shape: str, world_size: int, steps: int) -> list[dict]:
    experts, width, top_k = SHAPES[shape]
    tokens = BATCH * SEQ
    model = expert_costs(experts, width, MODEL_WIDTH, tokens * top_k, world_size, DEVICES["cpu"],
                         tokens=tokens)
    rows = []
    for mode in MODES:
        per_rank = run_on_ranks("bench.experts:_rank", world_size, shape, mode, steps)
        rows.append({"shape": shape, "experts": experts, "width": width, "top_k": top_k,
                     "world_size": world_size, "mode": mode,
                     "step_ms": 1e3 * max(r["step_s"] for r in per_rank),
                     "expert_mib": max(r["expert_bytes"] for r in per_rank) / 2**20,
                     "collectives": per_rank[0]["collectives"],
                     "model_ms": 1e3 * model[mode].seconds})
    winner = min(rows, key=lambda r: r["step_ms"])["mode"]
    auto = _auto_pick(shape, world_size)
    for r in rows:
        r.update(measured_winner=winner, auto=auto)
    return rows


def _collectives(c: dict) -> str:
    return "; ".join(f"{phase}: " + ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
                     for phase, ops in sorted(c.items()) if ops)


def table(rows: list[dict]) -> str:
    head = ("| shape | ranks | cut | step ms | expert MiB / rank | collectives per step | "
            "model ms | measured winner | auto picks | auto = winner |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['shape']} ({r['experts']} x {r['width']}, top-{r['top_k']}) | {r['world_size']} "
        f"| {r['mode']} | {r['step_ms']:.1f} | {r['expert_mib']:.2f} | "
        f"{_collectives(r['collectives'])} | {r['model_ms']:.1f} | {r['measured_winner']} | "
        f"{r['auto']} | {'yes' if r['auto'] == r['measured_winner'] else 'NO'} |" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = [r for ws in args.ranks for shape in SHAPES for r in measure(shape, ws, args.steps)]
    date = datetime.date.today().isoformat()
    text = (f"# Expert-TP against whole experts ({date})\n\n`python -m bench.experts "
            f"--steps {args.steps}` on {torch.__version__}, CPU gloo ranks, one thread each.\n\n"
            + table(rows) + "\n")
    out = RESULTS / f"experts-{date}.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
