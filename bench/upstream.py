"""tpcompile's plans of upstream model code: the model classes of libraries users train with.

    nice -n 19 python -m bench.upstream --numerics          # -> results/upstream-<date>.md
    python -m bench.upstream --only torch.TransformerEncoder litgpt.pythia --numerics
    python -m bench.upstream --only litgpt.pythia --numerics --merge  # into today's results

The libraries come from the package index (``pip install -e '.[bench]'``), never vendored:
PyTorch's own ``nn.Transformer*`` layers and ``nn.MultiheadAttention``, torchtitan's llama3 /
qwen3 / DeepSeek-V3 / llama4 (its ``ModelArgs`` at tiny sizes), litgpt's ``GPT`` under a few
``Config.from_name`` architectures (sizes overridden), torchtune's llama3 / qwen2 component
builders; torchtitan 0.3's llama3 / qwen3 / DeepSeek-V3 ``debugmodel`` configs (flex
attention only; one torchtitan installs at a time, so their rows come from a run of their own
merged in: ``pip install --no-deps -r .ci/torchtitan-0.3.txt``) and a Hugging Face Llama under
flex attention, whose gradients are compared with their captured graph's (torch has no CPU
backward for flex attention itself). Every other model is tiny (hidden 64, 2 layers, 4
heads, 2 KV heads where the model has GQA, intermediate 128, vocab 256), float32, random init
under ``torch.manual_seed(0)``, train mode, dropout 0; token models take ids 2 x 16, ``nn``
layers a float batch 2 x 16 x 64.

Each model is planned by ``tpcompile.explain`` at 2 and 4 ranks and judged as
bench/hf_sweep.py judges a transformers family (``hf_verdict.plan_row``: per-layer collectives
against Megatron's bound, weights Megatron shards left whole, parameter bytes against the
ideal split); with ``--numerics`` it also runs on 2 and 4 gloo ranks against the unsharded
model (``tpcompile.tools.numerics.compare``: the output and every gradient, exact at <= 1e-5).
A library that does not import, or a model that does not run unsharded on CPU, is a row with
the reason (*not importable*, *not built*).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

from bench.hf_configs import first_line
from bench.hf_numerics import TOLERANCE, rank_error, worst_of
from bench.hf_report import numerics_cell
from bench.hf_verdict import plan_row
from bench.upstream_models import CASES, build

RESULTS = Path(__file__).resolve().parent / "results"
WORLD_SIZES = (2, 4)
COMMAND = "nice -n 19 python -m bench.upstream --numerics"


def _numerics_rank(rank: int, world_size: int, names: list[str]) -> dict:
    """One rank of the gloo run: each case rebuilt, parallelized, compared with its unsharded
    self (``compare``: the output and every gradient); a case's failure is its own entry."""
    import torch

    import tpcompile
    from tpcompile.tools.numerics import compare

    torch.set_num_threads(1)
    out = {}
    for name in names:
        model, inputs, kwargs, _ = build(name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs or None)
                reference = _reference(name, model, inputs, kwargs)
                c = compare(reference, tp, inputs, kwargs=kwargs,
                            copy_model=reference is model)
        except Exception as e:  # noqa: BLE001 - a rank's failure is the row's numerics cell
            out[name] = {"error": first_line(e)}
            continue
        worst = max(c.grad_errs.items(), key=lambda kv: kv[1]) if c.grad_errs else ("", 0.0)
        out[name] = {"output_err": c.output_err, "max_grad_err": worst[1],
                     "worst_grad": worst[0], "grads": len(c.grad_errs)}
    return out


def _reference(name: str, model, inputs: tuple, kwargs: dict):
    """What ``name``'s sharded model is compared with: the model, or for a ``captured`` case
    its captured graph, whose flex attention's dense backward runs on CPU where the model's
    own is refused (its forward is the model's: torch.export)."""
    if CASES[name].reference != "captured":
        return model
    from tpcompile.core.capture import capture

    return capture(model, inputs, kwargs).gm


def run_numerics(names: list[str], world_size: int) -> dict[str, dict]:
    """Per case, the worst rank's output and gradient errors at ``world_size`` gloo ranks (one
    launch for all of ``names``)."""
    from tpcompile.tools.launch import run_on_ranks

    try:
        per_rank = run_on_ranks(f"{Path(__file__).resolve()}:_numerics_rank", world_size, names,
                                timeout=300 * len(names))
    except Exception as e:  # noqa: BLE001 - a rank's traceback: keep its exception line
        return {name: {"error": rank_error(e)} for name in names}
    return {name: worst_of([r[name] for r in per_rank], CASES[name].tolerance or TOLERANCE)
            for name in names}


def plan_at(name: str, world_size: int, built: tuple | None = None) -> dict:
    """Case ``name``'s plan at ``world_size`` ranks, judged as ``hf_verdict.plan_row`` judges one."""
    model, inputs, kwargs, shape = built or build(name)
    return plan_row({"family": name}, model, inputs, SimpleNamespace(**shape), world_size,
                    kwargs or None)


def measure(name: str, numerics: bool) -> dict:
    """One case's row: built unsharded, then planned (and run) at each of ``WORLD_SIZES``."""
    import torch

    row: dict = {"model": name, "library": CASES[name].library}
    try:
        model, inputs, kwargs, shape = build(name)
        with torch.no_grad():
            model(*inputs, **kwargs)
    except ImportError as e:
        return {**row, "status": "not importable", "why": first_line(e)}
    except Exception as e:  # noqa: BLE001 - a model that does not run unsharded here
        return {**row, "status": "not built", "why": first_line(e),
                "trace": traceback.format_exc()[-2000:]}
    for ws in WORLD_SIZES:
        plan = plan_at(name, ws, (model, inputs, kwargs, shape))
        if numerics and "per_layer" in plan and shape["num_attention_heads"] % ws == 0:
            plan["numerics"] = run_numerics([name], ws)[name]
            plan["exact"] = plan["numerics"].get("exact", False)
        row[ws] = plan
    row["status"] = row[WORLD_SIZES[0]]["status"]
    return row


# ------------------------------------------------------------------ the report

def _plan_cell(plan: dict | None) -> str:
    if plan is None:
        return "-"
    if "per_layer" not in plan:
        return f"{plan['status']}: {plan.get('why', '')[:120]}".replace("|", "/")
    extra = "; ".join(f"{n}x {k}" for k, n in {**plan["gathers"], **plan["fallbacks"]}.items())
    whole = "; ".join(sorted(plan["not_sharded"]))[:160]
    return (f"{plan['per_layer']} (bound {plan['megatron_bound']}), {plan['over_ideal']:+.0%} "
            f"params: **{plan['status']}**" + (f"; {extra[:160]}" if extra else "")
            + (f"; whole: {whole}" if whole else "")).replace("|", "/")


def summary(rows) -> str:
    plans = [r[ws] for r in rows for ws in WORLD_SIZES if ws in r]
    captured = [r for r in rows if r.get(WORLD_SIZES[0], {}).get("captured")]
    at = [p for p in plans if p["status"] == "at bound"]
    numerics = [p for p in plans if "numerics" in p]
    exact = [p for p in numerics if p.get("exact")]
    return (f"**{len(rows)} models, {len(captured)} captured; {len(at)} of {len(plans)} plans "
            f"(2 and 4 ranks) at Megatron's bound; {len(exact)} of {len(numerics)} gloo runs "
            f"exact.**")


def report_markdown(rows, meta) -> str:
    lines = [summary(rows), "",
             f"`{COMMAND}` ({meta['date']}; torch {meta['torch']}, "
             + ", ".join(f"{k} {v}" for k, v in meta["libraries"].items())
             + "). Generated by bench/upstream.py; plans from `tpcompile.explain`, judged as "
             "bench/hf_sweep.py judges a transformers family; numerics on gloo ranks, "
             f"tolerance {TOLERANCE:g}" + "".join(
                 f" ({n}: {c.tolerance:.2g}, bfloat16 experts)" for n, c in CASES.items()
                 if c.tolerance and any(r["model"] == n for r in rows))
             + "; a flex-attention model's gradients against its captured graph (torch has no "
             "CPU backward for its own). Cells: per-layer forward/backward all-reduces (the "
             "bound), parameter bytes per rank over the ideal split, status."
             + "".join(f" Re-measured on {d} (`--only ... --merge`): "
                       + ", ".join(m for m, when in meta.get("remeasured", {}).items() if when == d)
                       + "." for d in sorted(set(meta.get("remeasured", {}).values()))), "",
             "| model | library | 2 ranks | numerics 2 | 4 ranks | numerics 4 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if WORLD_SIZES[0] not in r:
            lines.append(f"| {r['model']} | {r['library']} | {r['status']}: "
                         f"{r.get('why', '')[:160].replace('|', '/')} | - | - | - |")
            continue
        cells = [c for ws in WORLD_SIZES for c in (_plan_cell(r.get(ws)), numerics_cell(r[ws]))]
        lines.append(f"| {r['model']} | {r['library']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for lib in ("torchtitan", "litgpt", "torchtune", "torchao", "transformers"):
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = "not installed"
    # one torchtitan installs at a time: its 0.2 and 0.3 rows are measured in two runs
    out["torchtitan 0.3"] = out["torchtitan"] if out["torchtitan"].startswith("0.3") \
        else "not installed"
    return out


def merged(rows: list[dict], path: Path) -> list[dict]:
    """The rows of the results file ``path`` (its JSON) with ``rows`` measured anew in their
    place, in ``CASES`` order: a few models re-run without re-running the corpus."""
    sizes = {str(ws): ws for ws in WORLD_SIZES}  # JSON keys are strings: back to ints
    old = [{sizes.get(k, k): v for k, v in r.items()} for r in json.loads(path.read_text())["rows"]]
    by_model = {r["model"]: r for r in old} | {r["model"]: r for r in rows}
    return [by_model[name] for name in CASES if name in by_model]


def _merged_meta(meta: dict, rows: list[dict], path: Path, today: str) -> dict:
    """The results file's own date and library versions (its other rows were measured with
    them), the versions of the re-run rows' libraries from this run, and which rows were
    re-measured when (``remeasured``: model -> date)."""
    old = json.loads(path.read_text())
    libraries = dict(old["libraries"])
    libraries.update({r["library"]: meta["libraries"][r["library"]] for r in rows
                      if r["library"] in meta["libraries"]})
    again = {**old.get("remeasured", {}), **{r["model"]: today for r in rows}}
    return {"date": old["date"], "torch": meta["torch"], "libraries": libraries,
            "remeasured": again}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="MODEL")
    parser.add_argument("--numerics", action="store_true", help="also run on 2 and 4 gloo ranks")
    parser.add_argument("--merge", metavar="DATE", nargs="?", const="today",
                        help="with --only: replace those rows in results/upstream-DATE.json "
                             "(default today's) and rewrite it and its .md")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = []
    for name in args.only or list(CASES):
        rows.append(measure(name, args.numerics))
        print(f"{name}: " + ", ".join(f"{ws}: {_plan_cell(rows[-1].get(ws))} "
                                      f"{numerics_cell(rows[-1].get(ws, {}))}"
                                      for ws in WORLD_SIZES), file=sys.stderr, flush=True)
    date = today = datetime.date.today().isoformat()
    meta = {"date": date, "torch": torch.__version__, "libraries": _versions()}
    if args.merge:
        date = date if args.merge == "today" else args.merge
        meta = _merged_meta(meta, rows, RESULTS / f"upstream-{date}.json", today)
        rows = merged(rows, RESULTS / f"upstream-{date}.json")
    text = report_markdown(rows, meta)
    if not args.only or args.merge:
        (RESULTS / f"upstream-{date}.md").write_text(text)
        (RESULTS / f"upstream-{date}.json").write_text(
            json.dumps({**meta, "rows": rows}, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
