"""Step time of the tensor-parallel variants of one model, side by side on the same ranks.

    python -m bench.step_time --world-size 2 --model llama             # gloo ranks on CPU
    torchrun --nproc-per-node 2 -m bench.step_time --device cuda ...    # NCCL on GPUs

Every rank builds the same model once and holds every variant at the same time:

    dtensor eager / compiled       parallelize_module + torchtitan-style plan (bench/baselines.py)
    tpcompile eager                tpcompile.parallelize(model, inputs)
    tpcompile compiled (+overlap)  torch.compile(tp, options=tpcompile.compile_options(overlap))
    tpcompile backend              torch.compile(model, backend=tpcompile.backend())
    unsharded                      the whole model on every rank (the ideal's compute term)

*Ideal* step time: the unsharded step (measured side by side, every rank running it at once,
so it sees the same contention) divided by N, plus the time of tpcompile's own collectives
replayed alone (the same calls, sizes and order, timed like a step). "vs ideal" is a variant's
step time over that.

Compiled variants compile cold (``fresh_inductor_cache``, after one throwaway compile pays
inductor's one-time imports): compile time is the first two forward + backward steps minus two
steady ones (the backend shards on its first call and compiles on the second). "To first
step" is what a user waits for: setup (parallelize) + compile + the first step. Timing is
round-robin in a shuffled order, step i of every variant before step i+1 of any, so a noisy
machine slows all variants alike; a step's time is the slowest rank's; the table shows medians.
"forward" is the training forward (autograd on), "step" is forward + loss +
backward. Collectives and their bytes (each rank's input buffers) come from the profiler on one
step. Prints a markdown table and writes bench/results/<model>-ws<N>-<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bench import baselines
import tpcompile
from tpcompile.tools import models
from tpcompile.tools.numerics import rel_err
from tpcompile.compile.inductor import collective_kind

RESULTS = Path(__file__).resolve().parent / "results"
UNSHARDED = "unsharded"
IDEAL_OF = "tpcompile eager"  # whose collectives the ideal's communication term replays


@dataclass(frozen=True)
class Config:
    model: str = "llama"
    world_size: int = 2
    device: str = "cpu"
    batch: int = 4
    seq: int = 128
    dim: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    hidden: int = 768
    vocab: int = 512
    steps: int = 20
    warmup: int = 2
    only: str = ""  # comma-separated variant names (default: all)


@dataclass
class Variant:
    name: str
    module: object          # callable: model inputs -> output
    params: list | None     # its parameters (None: read after the first call shards them)
    setup_s: float
    compiled: bool


def _build(cfg: Config) -> torch.nn.Module:
    return models.build(cfg.model, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
                        n_kv_heads=cfg.kv_heads, hidden=cfg.hidden, vocab=cfg.vocab,
                        max_seq=cfg.seq).to(cfg.device)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _variants(cfg: Config, model, inputs, mesh) -> list[Variant]:
    dt, dt_setup = _timed(lambda: baselines.parallelize_dtensor(copy.deepcopy(model), mesh))
    tp, tp_setup = _timed(lambda: tpcompile.parallelize(model, inputs, mesh))
    swapped = copy.deepcopy(model)
    every = [
        Variant("dtensor eager", dt, list(dt.parameters()), dt_setup, False),
        Variant("dtensor compiled", torch.compile(dt), list(dt.parameters()), dt_setup, True),
        Variant("tpcompile eager", tp, list(tp.parameters()), tp_setup, False),
        Variant("tpcompile compiled", torch.compile(
            tp, fullgraph=True, options=tpcompile.compile_options(overlap=False)),
            list(tp.parameters()), tp_setup, True),
        Variant("tpcompile compiled+overlap", torch.compile(
            tp, fullgraph=True, options=tpcompile.compile_options(overlap=True)),
            list(tp.parameters()), tp_setup, True),
        Variant("tpcompile backend", torch.compile(swapped, backend=tpcompile.backend(mesh=mesh)),
                None, 0.0, True),
        Variant(UNSHARDED, model, list(model.parameters()), 0.0, False),
    ]
    wanted = [w.strip() for w in cfg.only.split(",") if w.strip()]
    unknown = set(wanted) - {v.name for v in every}
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {[v.name for v in every]}")
    return [v for v in every if not wanted or v.name in wanted]


def _sync(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def _forward(cfg, v: Variant, inputs) -> float:
    dist.barrier()
    _, seconds = _timed(lambda: (v.module(*inputs), _sync(cfg)))
    return seconds


def _step(cfg, v: Variant, inputs, params) -> float:
    for p in params:
        p.grad = None
    dist.barrier()
    _, seconds = _timed(lambda: (v.module(*inputs).float().pow(2).mean().backward(), _sync(cfg)))
    return seconds


def _local_bytes(params) -> int:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # DTensor shards
    return sum(t.numel() * t.element_size() for t in local)


def _collectives(v: Variant, inputs) -> tuple[dict, int, list]:
    """Collectives of one forward + backward, the bytes of their per-rank input buffers, and
    the calls themselves as (kind, input shape) in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        v.module(*inputs).float().pow(2).mean().backward()
    counts, nbytes, calls = {}, 0, []
    for e in prof.events():
        namespace, _, op = e.name.partition("::")
        kind = collective_kind(op) if namespace == "_c10d_functional" else None
        if kind is None:
            continue
        counts[kind] = counts.get(kind, 0) + 1
        shape = e.input_shapes[0] if e.input_shapes else []
        nbytes += v.params[0].element_size() * int(torch.tensor(shape).prod().item())
        calls.append((kind, list(shape)))
    return counts, nbytes, calls


def _replay(cfg, calls: list, dtype) -> float:
    """One step's collectives alone: the same kinds and sizes, in order, timed like a step."""
    world = dist.get_world_size()
    buffers = [(kind, torch.ones(shape, dtype=dtype, device=cfg.device)) for kind, shape in calls]
    dist.barrier()
    start = time.perf_counter()
    for kind, t in buffers:
        if kind == "all_gather":
            dist.all_gather_into_tensor(t.new_empty((world * t.shape[0], *t.shape[1:])), t)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(t.new_empty((t.shape[0] // world, *t.shape[1:])), t)
        else:
            dist.all_reduce(t)
    _sync(cfg)
    return time.perf_counter() - start


def rank_main(rank: int, world_size: int, config: dict) -> dict:
    from torch._inductor.utils import fresh_inductor_cache
    from torch.distributed.device_mesh import init_device_mesh

    cfg = Config(**config)
    mesh = init_device_mesh(cfg.device, (world_size,))
    model = _build(cfg)
    inputs = tuple(x.to(cfg.device) for x in models.example_inputs(model, cfg.batch, cfg.seq))
    reference = model(*inputs).detach()
    variants = _variants(cfg, model, inputs, mesh)
    with fresh_inductor_cache():  # pay inductor's one-time imports before timing any compile
        warm = torch.randn(4, 4, device=cfg.device, requires_grad=True)
        torch.compile(lambda x: (x * 2).sum())(warm).backward()
    result = {}
    for v in variants:
        with fresh_inductor_cache():  # compiled cold; the backend compiles on its 2nd call
            first = sum(_step(cfg, v, inputs, v.params or []) for _ in range(2))
        v.params = list(v.module.parameters()) if v.params is None else v.params
        out = v.module(*inputs).detach()
        result[v.name] = {"first_s": first, "max_err": rel_err(out, reference),
                          "setup_s": v.setup_s, "compiled": v.compiled,
                          "param_bytes": _local_bytes(v.params)}
    for _ in range(cfg.warmup):
        for v in variants:
            _step(cfg, v, inputs, v.params)
    times = {v.name: {"forward": [], "step": []} for v in variants}
    order = random.Random(0)  # the same shuffled order on every rank, a new one every round
    for _ in range(cfg.steps):
        for v in order.sample(variants, len(variants)):
            times[v.name]["forward"].append(_forward(cfg, v, inputs))
        for v in order.sample(variants, len(variants)):
            times[v.name]["step"].append(_step(cfg, v, inputs, v.params))
    replayed = []
    for v in variants:
        counts, nbytes, calls = _collectives(v, inputs)
        result[v.name].update(times[v.name], collectives=counts, comm_bytes=nbytes)
        if v.name == IDEAL_OF:
            replayed = [_replay(cfg, calls, reference.dtype) for _ in range(cfg.steps)]
    if IDEAL_OF in result:
        result[IDEAL_OF]["comm"] = replayed
    return {"variants": result, "unsharded_param_bytes": _local_bytes(model.parameters())}


def summarize(per_rank: list[dict]) -> dict:
    """Per variant: medians over steps of the slowest rank's time; the rest from rank 0."""
    per_rank = [r["variants"] for r in per_rank]
    out, ideal_ms = {}, None
    if UNSHARDED in per_rank[0] and IDEAL_OF in per_rank[0]:
        n = len(per_rank)
        whole = statistics.median(max(r[UNSHARDED]["step"][i] for r in per_rank)
                                  for i in range(len(per_rank[0][UNSHARDED]["step"])))
        comm = statistics.median(max(r[IDEAL_OF]["comm"][i] for r in per_rank)
                                 for i in range(len(per_rank[0][IDEAL_OF]["comm"])))
        ideal_ms = 1e3 * (whole / n + comm)
    for name, r0 in per_rank[0].items():
        slowest = {k: [max(r[name][k][i] for r in per_rank) for i in range(len(r0[k]))]
                   for k in ("forward", "step")}
        step = statistics.median(slowest["step"])
        out[name] = {
            "forward_ms": 1e3 * statistics.median(slowest["forward"]),
            "step_ms": 1e3 * step,
            "compile_s": (max(r[name]["first_s"] for r in per_rank) - 2 * step
                          if r0["compiled"] else None),
            # parallelize (+ compile) + the first step: the two first steps less a steady one
            "to_first_step_s": r0["setup_s"] + max(r[name]["first_s"] for r in per_rank) - step,
            "setup_s": r0["setup_s"],
            "collectives": r0["collectives"], "comm_bytes": r0["comm_bytes"],
            "param_bytes": r0["param_bytes"], "max_err": max(r[name]["max_err"] for r in per_rank),
            "ideal_ms": ideal_ms,
        }
    return out


def table(summary: dict) -> str:
    first = next(iter(summary))
    base = summary[first]["step_ms"]
    rows = [f"| variant | forward ms | fwd+bwd ms | fwd+bwd vs {first} | setup s | compile s "
            "| to first step s | vs ideal | collectives / step | comm bytes / step "
            "| param bytes / rank | max rel err |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, s in summary.items():
        comm = ", ".join(f"{n} {k}" for k, n in sorted(s["collectives"].items())) or "none"
        compile_s = "-" if s["compile_s"] is None else f"{s['compile_s']:.1f}"
        ideal = ("-" if s["ideal_ms"] is None or name == UNSHARDED
                 else f"{s['step_ms'] / s['ideal_ms']:.2f}x")
        rows.append(f"| {name} | {s['forward_ms']:.1f} | {s['step_ms']:.1f} | "
                    f"{s['step_ms'] / base:.2f}x | {s['setup_s']:.1f} | {compile_s} | "
                    f"{s['to_first_step_s']:.1f} | {ideal} | {comm} | "
                    f"{s['comm_bytes']:,} | "
                    f"{s['param_bytes']:,} | {s['max_err']:.1e} |")
    return "\n".join(rows)


def _report(cfg: Config, per_rank: list[dict], load: tuple) -> None:
    summary = summarize(per_rank)
    full = per_rank[0]["unsharded_param_bytes"]
    print(f"{cfg.model}, {cfg.world_size} ranks ({cfg.device}), batch {cfg.batch}, seq {cfg.seq}, "
          f"dim {cfg.dim}, {cfg.layers} layers, median of {cfg.steps} steps; unsharded "
          f"parameters {full:,} bytes\n")
    print(table(summary))
    RESULTS.mkdir(exist_ok=True)
    suffix = "-" + cfg.only.replace(" ", "_").replace(",", "-") if cfg.only else ""
    path = RESULTS / f"{cfg.model}-ws{cfg.world_size}-{cfg.device}{suffix}.json"
    path.write_text(json.dumps({"config": asdict(cfg), "torch": torch.__version__,
                                "cpus": os.cpu_count(), "loadavg_before_after": load,
                                "unsharded_param_bytes": full, "variants": summary},
                               indent=1, default=str))
    print(f"\nwrote {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(Config()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    cfg = Config(**vars(p.parse_args(argv)))
    load = os.getloadavg()
    if "LOCAL_RANK" in os.environ:  # under torchrun: NCCL on this process's GPU
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        ws = dist.get_world_size()
        cfg = Config(**{**asdict(cfg), "world_size": ws})
        mine = rank_main(dist.get_rank(), ws, asdict(cfg))
        per_rank = [None] * ws
        dist.all_gather_object(per_rank, mine)
        if dist.get_rank() == 0:
            _report(cfg, per_rank, (load, os.getloadavg()))
        dist.destroy_process_group()
        return
    from tpcompile.tools.launch import run_on_ranks

    per_rank = run_on_ranks(f"{Path(__file__).resolve()}:rank_main", cfg.world_size, asdict(cfg),
                            timeout=3600)
    _report(cfg, per_rank, (load, os.getloadavg()))


if __name__ == "__main__":
    main()
