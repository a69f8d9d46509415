"""tpcompile's plans of every transformer / UNet model class of the installed diffusers, tiny.

    nice -n 19 python -m bench.diffusers_sweep --numerics   # -> results/diffusers_sweep.md, .json
    python -m bench.diffusers_sweep --only FluxTransformer2DModel --numerics   # printed only

What bench/hf_sweep.py is for causal LMs, for diffusers: the classes, their tiny configs and
example inputs come from bench/diffusers_configs.py. Each class runs in its own subprocess
with a timeout (a hang or a crash is a row): the wrapped model runs unsharded (a class that
fails here is *not built*: this sweep's config or inputs, not tpcompile), then
``tpcompile.explain(model, inputs, 2)`` judged against Megatron's bound derived from the model
(bench/hf_verdict.py's ``plan_row``: the same statuses) and, with ``--numerics``, the output
and every gradient on 2 gloo ranks against the unsharded model (``exact`` within 1e-5).
The report reuses bench/hf_report.py's cells and categories.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

from bench.diffusers_configs import build, classes, n_layers
from bench.hf_configs import first_line
from bench.hf_numerics import NUMERICS_TIMEOUT_S, TOLERANCE, WORLD_SIZE
from bench.hf_report import category, counts, numerics_cell
from bench.hf_verdict import plan_row

RESULTS = Path(__file__).resolve().parent / "results"
TIMEOUT_S = 120
COMMAND = "nice -n 19 python -m bench.diffusers_sweep --numerics"


def _numerics_rank(rank: int, world_size: int, name: str) -> dict:
    import torch

    import tpcompile
    from tpcompile.tools.numerics import compare

    torch.set_num_threads(1)
    model = build(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = compare(model, tpcompile.parallelize(model, model.inputs), model.inputs)
    except Exception as e:  # noqa: BLE001
        return {"error": first_line(e), "detail": str(e)[:2000]}
    worst = max(c.grad_errs.items(), key=lambda kv: kv[1]) if c.grad_errs else ("", 0.0)
    return {"output_err": c.output_err, "max_grad_err": worst[1], "worst_grad": worst[0]}


def run_numerics(name: str) -> dict:
    """The output and every gradient on 2 gloo ranks against the unsharded model, float32."""
    from tpcompile.tools.launch import run_on_ranks

    try:
        per_rank = run_on_ranks(f"{Path(__file__).resolve()}:_numerics_rank", WORLD_SIZE, name,
                                timeout=NUMERICS_TIMEOUT_S - 20)
    except Exception as e:  # noqa: BLE001
        return {"error": first_line(e)}
    failed = [r for r in per_rank if "error" in r]
    if failed:
        return failed[0]
    worst = max(per_rank, key=lambda r: r["max_grad_err"])
    out = max(r["output_err"] for r in per_rank)
    return {"output_err": out, "max_grad_err": worst["max_grad_err"],
            "worst_grad": worst["worst_grad"],
            "exact": max(out, worst["max_grad_err"]) <= TOLERANCE}


def measure(name: str, numerics: bool) -> dict:
    import torch

    row: dict = {"family": name}
    try:
        model = build(name)
        with torch.no_grad():
            model(*model.inputs)
    except Exception as e:  # noqa: BLE001 - a class this sweep cannot build or run unsharded
        return {**row, "status": "not built", "why": first_line(e),
                "trace": traceback.format_exc()[-3000:]}
    row["inputs"] = {k: list(v.shape) for k, v in zip(model.names, model.inputs)}
    row["n_params"] = sum(p.numel() for p in model.parameters())
    cfg = SimpleNamespace(num_hidden_layers=n_layers(model))
    row = plan_row(row, model, model.inputs, cfg, WORLD_SIZE)
    if numerics and "per_layer" in row:
        row["numerics"] = run_numerics(name)
        row["exact"] = row["numerics"].get("exact", False)
    return row


def run_one_subprocess(name: str, numerics: bool) -> dict:
    timeout = TIMEOUT_S + (NUMERICS_TIMEOUT_S if numerics else 0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "bench.diffusers_sweep", "--one", name, "--out", str(out)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd + (["--numerics"] if numerics else []), capture_output=True,
                                  text=True, timeout=timeout,
                                  cwd=Path(__file__).resolve().parents[1],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            return {"family": name, "status": "timeout", "why": f"no result in {timeout} s",
                    "seconds": time.perf_counter() - start}
        if out.exists():
            return json.loads(out.read_text())
        return {"family": name, "status": "crash",
                "why": f"exit {proc.returncode}: {first_line(proc.stderr)}",
                "trace": proc.stderr[-3000:], "seconds": time.perf_counter() - start}


def _one(name: str, out: str, numerics: bool) -> None:
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    Path(out).write_text(json.dumps(measure(name, numerics), default=str))


def summary(rows) -> str:
    n = counts(rows)
    return (f"**{len(rows)} classes: {n['captured']} captured, {n['at']} at the bound, "
            f"{n['exact']} exact.**")


def report_markdown(rows, meta) -> str:
    lines = [summary(rows), "",
             f"`{meta['command']}` on {meta['date']} (torch {meta['torch']}, diffusers "
             f"{meta['diffusers']}, {WORLD_SIZE} ranks, float32, train mode; load average "
             f"{meta['load']} at the start). Generated by bench/diffusers_sweep.py; configs "
             "and inputs: bench/diffusers_configs.py; plans from `tpcompile.explain`, numerics "
             f"on gloo ranks (`tpcompile.tools.numerics.compare`, tolerance {TOLERANCE:g})"
             + ("" if meta["numerics"] else " not run") + ".", "",
             "## Reasons", "", "| category | classes | examples |", "|---|---:|---|"]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(category(r) or "at bound", []).append(r["family"])
    for cat, names in sorted(by_cat.items(), key=lambda kv: -len(kv[1])):
        ex = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        lines.append(f"| {cat.replace('|', '/')} | {len(names)} | {ex} |")
    lines += ["", "## Classes", "",
              "| class | captured | params / rank (KiB) | ideal (KiB) | per layer fwd/bwd "
              "| Megatron bound | gathers / fallbacks | kept whole (first) | numerics out / grad "
              "| status |", "|---|---|---:|---:|---|---|---|---|---|---|"]
    for r in rows:
        why = r.get("why", "").replace("|", "/")[:160]
        if "per_layer" not in r:
            lines.append(f"| {r['family']} | {'yes' if r.get('captured') else 'no'} "
                         f"|  |  |  |  |  |  |  | {r['status']}: {why} |")
            continue
        extra = "; ".join(f"{n}x {k}" for k, n in {**r["gathers"], **r["fallbacks"]}.items())
        whole = "; ".join(f"{k}: {v}" for k, v in sorted(r["not_sharded"].items())[:2])
        lines.append(
            f"| {r['family']} | yes | {r['param_bytes_max_rank'] / 1024:.1f} | "
            f"{r['param_bytes_ideal'] / 1024:.1f} | {r['per_layer']} | {r['megatron_bound']} | "
            f"{extra.replace('|', '/')[:200] or '-'} | {whole.replace('|', '/')[:200] or '-'} | "
            f"{numerics_cell(r).replace('|', '/')} | {r['status']}"
            f"{', exact' if r.get('exact') else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="these classes (printed, no results file)")
    parser.add_argument("--numerics", action="store_true",
                        help="also run the classes that plan on 2 gloo ranks")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _one(args.one, args.out, args.numerics)
    import diffusers
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "numerics": args.numerics,
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "command": COMMAND if args.numerics else COMMAND.replace(" --numerics", "")}
    rows = []
    for name in args.only or sorted(classes()):
        rows.append(run_one_subprocess(name, args.numerics))
        r = rows[-1]
        print(f"[{r.get('seconds', 0):5.1f}s] {name}: {r['status']} {r.get('why', '')[:150]} "
              f"{numerics_cell(r) if args.numerics else ''}", file=sys.stderr, flush=True)
    text = report_markdown(rows, meta)
    if not args.only:
        (RESULTS / "diffusers_sweep.json").write_text(
            json.dumps({**meta, "rows": rows}, indent=1, default=str))
        (RESULTS / "diffusers_sweep.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
