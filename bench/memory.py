"""Parameter and activation memory per rank of the built-in models at world sizes 1, 2 and 4.

    python -m bench.memory                 # markdown table on stdout, JSON in bench/results/
    python -m bench.memory --world-sizes 1 2 --models llama
    python -m bench.memory --mesh          # TP x FSDP2 at 4 ranks: (dp, tp) in (1,4) (2,2) (4,1)
    python -m bench.memory --checkpointing # none / full / selective at 1, 2, 4 ranks

*Parameter memory*: bytes of this rank's ``tp.state_dict()`` (shards + replicated tensors).
*Activation memory*: bytes of the tensors autograd saves for backward during one forward, the
memory a training step holds at the forward/backward boundary. Measured with
``torch.autograd.graph.saved_tensors_hooks``: each distinct storage counted once, parameter
storages left out (they are parameter memory). World size 1 is the unsharded model.

*Versus the ideal* (``--vs-ideal``): per-rank trainable parameter bytes of the largest rank
against ``sharded / N + replicated``, where *sharded* is every tensor the plan cuts and
*replicated* every tensor it keeps whole; the gap is what uneven shards cost. Read from the plan
without a process group (``tpcompile.explain``: the shapes ``materialize_params`` allocates),
so it also covers Llama-7B and 70B shapes built on meta at world size 8.

*2-D meshes* (``--mesh``): Llama at 4 ranks as (dp, tp) in (1, 4), (2, 2), (4, 1): TP over
``mesh["tp"]``, FSDP2 over ``mesh["dp"]`` (``tpcompile.fully_shard_blocks``; none at dp 1).
After one AdamW step, the largest rank's parameter, gradient and optimizer-state bytes (local
shards only) against the ideal, a quarter of the unsharded model's.

Without sequence parallelism the residual stream, norms and embeddings stay replicated, so
activations shrink less than parameters; with it (``sequence_parallel=True``) they shrink by
about the world size too. World size 1 has no SP column (there is nothing to shard).
*Full checkpointing*: ``activation_checkpointing="full"``, every block recomputed in backward;
what stays is each block's input (whole on every rank) and the layers outside the blocks.

*Checkpointing* (``--checkpointing``): MLP and Llama with ``activation_checkpointing`` None,
"full" and "selective" at each world size, against world size 1 with the same checkpointing:
per rank the saved bytes (as above; "-" for "selective", whose kept outputs
``saved_tensors_hooks`` do not see), the bytes still alive when the forward returns and the
peak over forward and backward (``tpcompile.tools.numerics.activation_memory``: storages
that ops allocate, parameters and inputs left out; gradients and the output included; the
smaller of two runs), and the median time of a forward + backward.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

import tpcompile
from tpcompile.tools import models
from tpcompile.tools.numerics import activation_memory, saved_activation_bytes
from tpcompile.tools.launch import run_on_ranks

MODELS = ("mlp", "gpt2", "llama")
# larger than the test fixtures so that activations, not constants, dominate
CONFIG = {"dim": 256, "hidden": 1024, "n_layers": 2, "n_heads": 8, "vocab": 512, "max_seq": 128}
BATCH, SEQ = 4, 128
NOT_AVAILABLE = "-"
RESULTS = Path(__file__).parent / "results"


def _rank_main(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        model = models.build(name, **CONFIG)
        inputs = models.example_inputs(model, BATCH, SEQ)
        tp = tpcompile.parallelize(model, inputs)
        sp = tpcompile.parallelize(model, inputs, sequence_parallel=True) if world_size > 1 else None
        ckpt = tpcompile.parallelize(model, inputs, activation_checkpointing="full")
        out[name] = {
            "param_bytes": sum(t.numel() * t.element_size() for t in tp.state_dict().values()),
            "full_param_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
            "activation_bytes": saved_activation_bytes(tp, inputs),
            "activation_bytes_sp": None if sp is None else saved_activation_bytes(sp, inputs),
            "activation_bytes_ckpt": saved_activation_bytes(ckpt, inputs),
        }
    return out


MESHES = ((1, 4), (2, 2), (4, 1))


def _mesh_rank_main(rank: int, world_size: int, dp: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tpcompile.state.chunks import local_of

    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "tp"))
    model = models.build("llama", **CONFIG)
    tokens = models.example_inputs(model, BATCH, SEQ)[0].chunk(dp)[mesh["dp"].get_local_rank()]
    tp = tpcompile.parallelize(model, (tokens,), mesh=mesh["tp"])
    if dp > 1:
        tpcompile.fully_shard_blocks(tp, mesh["dp"])
    opt = torch.optim.AdamW(tp.parameters())
    tp(tokens).float().pow(2).mean().backward()
    opt.step()

    def nbytes(ts):
        return sum(local_of(t).numel() * t.element_size() for t in ts)
    states = [v for s in opt.state.values() for v in s.values() if v.ndim]  # moments, not step
    return {"param_bytes": nbytes(p.detach() for p in tp.parameters()),
            "grad_bytes": nbytes(p.grad for p in tp.parameters()),
            "optim_bytes": nbytes(states),
            "full_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _largest(per_rank: list[dict], fields) -> dict:
    """Each field's largest value over the ranks (None where a rank has none)."""
    values = {f: [r[f] for r in per_rank] for f in fields}
    return {f: None if None in v else max(v) for f, v in values.items()}


def measure_meshes(world_size: int = 4) -> list[dict]:
    rows = []
    for dp, tp_size in MESHES:
        per_rank = run_on_ranks(f"{__file__}:_mesh_rank_main", world_size, dp)
        full = per_rank[0]["full_param_bytes"]
        largest = _largest(per_rank, ("param_bytes", "grad_bytes", "optim_bytes"))
        rows.append({"dp": dp, "tp": tp_size, "ideal_param_bytes": full / world_size,
                     **{f"max_{key}": value for key, value in largest.items()}})
    return rows


def mesh_markdown(rows: list[dict]) -> str:
    lines = ["| (dp, tp) | parameters (MiB) | gradients (MiB) | optimizer state (MiB) "
             "| ideal: params, grads / optimizer (MiB) | parameters over ideal |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ideal = r["ideal_param_bytes"]
        lines.append(f"| ({r['dp']}, {r['tp']}) | {_mib(r['max_param_bytes'])} | "
                     f"{_mib(r['max_grad_bytes'])} | {_mib(r['max_optim_bytes'])} | "
                     f"{_mib(ideal)} / {_mib(2 * ideal)} | {r['max_param_bytes'] / ideal - 1:.1%} |")
    return "\n".join(lines)


CHECKPOINTING = (None, "full", "selective")


def _step_ms(tp, inputs, repeats: int = 5) -> float:
    """Median milliseconds of a forward + backward."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tp(*inputs).float().sum().backward()
        times.append(time.perf_counter() - start)
    tp.zero_grad()
    return 1e3 * statistics.median(times)


def _checkpointing_rank_main(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        model = models.build(name, **CONFIG)
        inputs = models.example_inputs(model, BATCH, SEQ)
        for mode in CHECKPOINTING:
            tp = tpcompile.parallelize(model, inputs, activation_checkpointing=mode)
            # the smaller of two runs: a gloo collective's buffer was once seen alive after its
            # wait (one rank, one row of 18), inflating "held" by that buffer
            held, peak = map(min, zip(*(activation_memory(tp, inputs) for _ in range(2))))
            out[f"{name}:{mode}"] = {
                "saved": None if mode == "selective" else saved_activation_bytes(tp, inputs),
                "held": held, "peak": peak, "step_ms": _step_ms(tp, inputs)}
    return out


def measure_checkpointing(world_sizes, names) -> list[dict]:
    """One row per model, checkpointing and world size: the largest rank's figures."""
    rows = []
    for ws in world_sizes:
        per_rank = run_on_ranks(f"{__file__}:_checkpointing_rank_main", ws, list(names))
        for key in per_rank[0]:
            name, _, mode = key.partition(":")
            largest = _largest([r[key] for r in per_rank], ("saved", "held", "peak", "step_ms"))
            rows.append({"model": name, "checkpointing": mode, "world_size": ws, **largest})
    return rows


def checkpointing_markdown(rows: list[dict]) -> str:
    lines = ["| model | checkpointing | ranks | saved (MiB) | held (MiB) "
             "| ranks 1 held / ranks (MiB) | held over that | peak (MiB) | forward + backward (ms) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    unsharded = {(r["model"], r["checkpointing"]): r["held"] for r in rows if r["world_size"] == 1}
    for r in rows:
        share = unsharded.get((r["model"], r["checkpointing"]))
        share = None if share is None else share / r["world_size"]
        over = "" if share is None else f"{r['held'] / share:.2f}x"
        mode = "none" if r["checkpointing"] == "None" else r["checkpointing"]
        lines.append(f"| {r['model']} | {mode} | {r['world_size']} | {_mib(r['saved'])} "
                     f"| {_mib(r['held'])} | {_mib(share)} | {over} | {_mib(r['peak'])} "
                     f"| {r['step_ms']:.1f} |")
    return "\n".join(lines)


def measure(world_sizes, names) -> list[dict]:
    rows = []
    for ws in world_sizes:
        per_rank = run_on_ranks(f"{__file__}:_rank_main", ws, list(names))
        for name in names:
            r = per_rank[0][name]  # rank 0 holds the most when shards are uneven
            rows.append({"model": name, "world_size": ws, **r,
                         "max_param_bytes": max(p[name]["param_bytes"] for p in per_rank),
                         "max_activation_bytes": max(p[name]["activation_bytes"] for p in per_rank),
                         "max_activation_bytes_ckpt": max(p[name]["activation_bytes_ckpt"]
                                                          for p in per_rank)})
    return rows


def ideal_split(report, sharded=lambda fqn, entry: entry.style != "replicate") -> tuple[int, int]:
    """(sharded, replicated) trainable parameter bytes of ``report``, each tensor once.

    ``sharded(fqn, entry)`` says which side a tensor is on: by default the plan's own styles;
    ``bench/idioms.py`` passes what a Megatron-style plan would shard instead (a fraction: the
    part of a fused weight it cuts).
    """
    unique = {tuple(e.aliases): (name, e) for name, e in report.params.items() if e.trainable}
    split = [0.0, 0.0]
    for name, e in unique.values():
        size = math.prod(e.global_shape) * getattr(torch, e.dtype).itemsize
        cut = float(sharded(name, e))
        split[0] += size * cut
        split[1] += size * (1 - cut)
    return split[0], split[1]


def vs_ideal(name: str, model, inputs, world_size: int) -> dict:
    """Largest rank's trainable parameter bytes against sharded / N + replicated."""
    report = tpcompile.explain(model, inputs, world_size)
    sharded, replicated = ideal_split(report)
    ideal = sharded / world_size + replicated
    actual = max(report.param_bytes_per_rank)
    return {"model": name, "world_size": world_size, "sharded_bytes": sharded,
            "replicated_bytes": replicated, "ideal_bytes": ideal, "max_rank_bytes": actual,
            "over_ideal": actual / ideal - 1}


def ideal_matrix() -> list[dict]:
    rows = []
    for name in MODELS:
        model = models.build(name, **CONFIG)
        for ws in (2, 4, 8):
            rows.append(vs_ideal(name, model, models.example_inputs(model, BATCH, SEQ), ws))
    uneven = models.build("llama", dim=96, n_heads=6, n_kv_heads=6, hidden=100, n_layers=2)
    rows.append(vs_ideal("llama, 6 heads, hidden 100 (uneven)", uneven,
                         models.example_inputs(uneven, BATCH, 16), 4))
    for label, shape in (("llama 7B shape", dict(dim=4096, n_layers=32, n_heads=32, hidden=11008)),
                         ("llama 70B shape, 8 layers", dict(dim=8192, n_layers=8, n_heads=64,
                                                            hidden=28672))):
        with torch.device("meta"):
            model = models.build("llama", vocab=32000, n_kv_heads=8, max_seq=2048, **shape)
        tokens = torch.zeros(2, 2048, dtype=torch.long, device="meta")
        rows.append(vs_ideal(label, model, (tokens,), 8))
    return rows


def ideal_markdown(rows: list[dict]) -> str:
    lines = ["| model | ranks | sharded (MiB) | replicated (MiB) | ideal / rank (MiB) "
             "| largest rank (MiB) | over ideal |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['world_size']} | {_mib(r['sharded_bytes'])} | "
                     f"{_mib(r['replicated_bytes'])} | {_mib(r['ideal_bytes'])} | "
                     f"{_mib(r['max_rank_bytes'])} | {r['over_ideal']:.2%} |")
    return "\n".join(lines)


def _mib(n) -> str:
    return NOT_AVAILABLE if n is None else f"{n / 2**20:.2f}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | ranks | parameters / rank (MiB) | of full | activations / rank, no SP (MiB) "
        "| of ws 1 | activations / rank, SP (MiB) | activations / rank, full checkpointing (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {r["model"]: r["max_activation_bytes"] for r in rows if r["world_size"] == 1}
    for r in rows:
        act_share = (f"{r['max_activation_bytes'] / base[r['model']]:.0%}"
                     if r["model"] in base else "")
        lines.append(
            f"| {r['model']} | {r['world_size']} | {_mib(r['max_param_bytes'])} "
            f"| {r['max_param_bytes'] / r['full_param_bytes']:.0%} | {_mib(r['max_activation_bytes'])} "
            f"| {act_share} | {_mib(r['activation_bytes_sp'])} "
            f"| {_mib(r['max_activation_bytes_ckpt'])} |")
    return "\n".join(lines)


def _write(stem: str, payload: dict, table: str, header: str = "") -> None:
    """``bench/results/<stem>.json`` and ``.md``, and the table on stdout."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (RESULTS / f"{stem}.md").write_text(table + "\n")
    if header:
        print(header + "\n")
    print(table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--vs-ideal", action="store_true",
                        help="parameter bytes against the ideal, from plans (no process group)")
    parser.add_argument("--mesh", action="store_true",
                        help="parameter, gradient, optimizer bytes at 4 ranks as (dp, tp) meshes")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activations and step time with checkpointing none / full / selective"
                             " (MLP and Llama)")
    args = parser.parse_args(argv)
    setup = {"config": CONFIG, "batch": BATCH, "seq": SEQ, "dtype": "float32",
             "torch": torch.__version__}
    if args.checkpointing:
        rows = measure_checkpointing(args.world_sizes, [n for n in args.models if n != "gpt2"])
        _write("memory-checkpointing", {"setup": setup, "rows": rows}, checkpointing_markdown(rows),
               f"batch {BATCH}, seq {SEQ}, config {CONFIG}, float32; the largest rank per row")
    elif args.mesh:
        rows = measure_meshes()
        _write("memory-mesh", {"config": CONFIG, "rows": rows}, mesh_markdown(rows),
               f"llama {CONFIG}, float32, AdamW, 4 ranks; the largest rank per row")
    elif args.vs_ideal:
        rows = ideal_matrix()
        _write("memory-ideal", {"rows": rows}, ideal_markdown(rows))
    else:
        rows = measure(args.world_sizes, args.models)
        _write("memory", {"setup": setup, "rows": rows}, markdown(rows),
               f"batch {BATCH}, seq {SEQ}, config {CONFIG}, float32; the largest rank per row")


if __name__ == "__main__":
    main()
