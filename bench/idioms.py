"""tpcompile's plans of the idiom corpus (zoo/idioms) against Megatron-style plans.

    python -m bench.idioms --numerics         # every idiom at 2 and 4 ranks -> results/idioms.md
                                              # and the idiom table of docs/models.md
    python -m bench.idioms --only alibi --world-sizes 2 --json /tmp/alibi.json

Plans come from ``tpcompile.explain``'s report, with no process group; the other ranks' graphs
are rewritten from the same capture and plan. Per idiom and world size:

* *status*: ``ok``, ``ok (static shapes)`` when capture fell back to the example's sizes, or the
  error's type and first line (every rank's graph is rewritten; the report shows rank 0's);
* *params / rank*: the largest rank's trainable parameter bytes against the ideal
  ``sharded / N + replicated``, where *sharded* is what the idiom's ``Expect`` says a Megatron
  plan cuts (``bench/memory.py``'s ``ideal_split`` with those globs, not the plan's own styles);
* collectives per layer, forward / backward: tpcompile's, the bound the report derives from the
  model (``report.megatron``, :mod:`tpcompile.inspect.bound.bound`), and the idiom's Megatron bound (``Expect``:
  1 + 1 per chain; replicated K / V and an MoE's routing weights have their gradients synced in
  the block input's all-reduce; an MoE is one chain, its experts' partial sums added before
  one all-reduce; a chunk kept whole inside a fused weight or a norm over sharded features
  costs what the idiom's ``Expect`` says);
* *bytes over bound*: the bytes the plan's collectives carry per step beyond the bytes of the
  bound derived from the model (:mod:`tpcompile.inspect.bound.bound_bytes`), ``?`` where a
  size depends on the data (a MoE's routed rows); a row is Megatron's plan only at ``+0``;
* *not as expected*: parameters whose style is not the expected one, or whose shards differ
  between ranks (every width here divides by 2 and 4); layer and expert indices folded to ``*``;
* *outside layers*: collectives outside the blocks; *gathers / fallbacks*: every all-gather or
  reduce-scatter, and every op without a sharding rule.

``--numerics`` also runs every idiom on local gloo ranks (``tpcompile.parallelize``) and
reports the largest relative error of the logits and of any gradient against the unsharded
model (``tpcompile.tools.numerics.compare``; the test suite's tolerance is 1e-5), at the
example's batch and length and again at others (the capture keeps them symbolic).

The markdown also lists, per row that is not the Megatron plan, the planner's reason for each
unexpected style and each fallback: what to fix.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

import tpcompile
from bench.memory import ideal_split
from tpcompile.inspect.explain.explain import report_of
from tpcompile.inspect.trace import rewrite_rank, trace_rewrite
from tpcompile.inspect.traffic import bytes_over_bound
from tpcompile.tools.launch import run_on_ranks
from zoo import idioms

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, SEQ = 2, 16
COMMAND = "python -m bench.idioms --numerics"
TOLERANCE = 1e-5


def _fold(name: str) -> str:
    """'layers.1.mlp.experts.3.w1.weight' -> 'layers.*.mlp.experts.*.w1.weight'."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def _per_layer(rows, fields) -> str:
    """'2/2' when every layer has the same counts, else each layer's."""
    values = [("/".join(str(getattr(m, f)) for f in fields)) for m in rows]
    return values[0] if len(set(values)) == 1 else ", ".join(values) if values else "-"


def measure(name: str, world_size: int) -> dict:
    expect = idioms.EXPECT[name].at(world_size)
    model, inputs = idioms.build(name), idioms.example_inputs(BATCH, SEQ, name=name)
    row = {"idiom": name, "world_size": world_size,
           "megatron_bound": f"{expect.fwd_allreduce_per_layer}/{expect.bwd_allreduce_per_layer}"}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace = trace_rewrite(model, inputs, world_size, copy_weights=False)
            report = report_of(trace, model, inputs)
    except Exception as e:  # noqa: BLE001 - an idiom tpcompile cannot plan is a measurement
        return {**row, "status": _first_line(e), "seconds": time.perf_counter() - start}
    static = any("accepts only" in str(w.message) for w in caught)
    sharded, replicated = ideal_split(report, lambda fqn, _: expect.cut(fqn))
    ideal = sharded / world_size + replicated
    actual = max(report.param_bytes_per_rank)
    layers = [m for m in report.megatron if m.layer]
    outside = [m for m in report.megatron if not m.layer]
    wrong = {f"{_fold(fqn)}: not planned": "" for fqn, _ in model.named_parameters()
             if fqn not in report.params}
    for fqn, p in report.params.items():
        want = expect.style(fqn) if p.trainable else "replicate"
        if p.style != want:
            wrong.setdefault(f"{_fold(fqn)}: {p.style} (want {want})", p.reason)
        elif p.dim is not None and len({tuple(s) for s in p.local_shapes}) > 1:
            sizes = ", ".join(str(s[p.dim]) for s in p.local_shapes)
            wrong.setdefault(f"{_fold(fqn)}: {p.style}, uneven shards {sizes}", p.reason)
    gathers = Counter(f"{c.phase} {c.op} ({_fold(c.module) or 'top level'})"
                      for c in report.collectives if c.op != "all_reduce")
    fallbacks = Counter(f"{_fold(f['module']) or 'top level'}: {f['reason']}"
                        for f in report.fallbacks)
    status = "ok (static shapes)" if static else "ok"
    for rank in range(1, world_size):  # the report is of rank 0's graph; each rank's rewrite
        try:                           # runs (from the same plan: captured once)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rewrite_rank(trace, rank)
        except Exception as e:  # noqa: BLE001
            status = f"rank {rank}: {_first_line(e)}"
            break
    return {
        **row, "status": status, "seconds": time.perf_counter() - start,
        "param_bytes_max_rank": actual, "param_bytes_ideal": ideal,
        "over_ideal": actual / ideal - 1,
        "per_layer": _per_layer(layers, ("forward", "backward")),
        "derived_bound": _per_layer(layers, ("bound_forward", "bound_backward")),
        "kept_whole": sorted({_fold(w) for m in report.megatron for w in m.whole}),
        "outside_layers": _per_layer(outside, ("forward", "backward")) if outside else "-",
        "at_megatron_bound": (not outside and bool(layers) and all(
            (m.forward, m.backward) == (expect.fwd_allreduce_per_layer,
                                        expect.bwd_allreduce_per_layer) for m in layers)
            and not any(c.op != "all_reduce" for c in report.collectives)),
        # the collectives' bytes against the bound's over the model (None: a size the data
        # decides, a MoE's routed rows)
        "bytes_over_bound": bytes_over_bound(report.megatron),
        "not_as_expected": wrong,
        "gathers": dict(gathers), "fallbacks": dict(fallbacks),
        "kept_replicated": sorted({f"{_fold(k['module']) or 'top level'}: {k['reason']}"
                                   for k in report.kept_replicated}),
    }


def _numerics_rank(rank: int, world_size: int, names: list[str]) -> dict:
    """On each gloo rank: name -> (output error, largest gradient error) or the error's line."""
    from tpcompile.tools.numerics import compare

    out = {}
    for name in names:
        model, inputs = idioms.build(name), idioms.example_inputs(BATCH, SEQ, name=name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tp = tpcompile.parallelize(model, inputs)
                c = compare(model, tp, inputs)
                # and at another batch and length: sizes the graph computes from symbolic dims
                # (a merged batch * heads, say) must follow the call, not the example
                tp.zero_grad()
                other = compare(model, tp, idioms.example_inputs(BATCH + 1, SEQ - 5, seed=1,
                                                                      name=name))
            out[name] = (max(c.output_err, other.output_err), max(c.max_grad_err, other.max_grad_err))
        except Exception as e:  # noqa: BLE001 - raised alike on every rank (plans agree)
            out[name] = _first_line(e)
    return out


def numerics(names: list[str], world_size: int) -> dict[str, str]:
    per_rank = run_on_ranks(f"{Path(__file__).resolve()}:_numerics_rank", world_size, names)
    result = {}
    for name in names:
        got = [r[name] for r in per_rank]
        if any(isinstance(g, str) for g in got):
            result[name] = next(g for g in got if isinstance(g, str))
            continue
        out_err, grad_err = max(g[0] for g in got), max(g[1] for g in got)
        verdict = "" if max(out_err, grad_err) <= TOLERANCE else " MISMATCH"
        result[name] = f"{out_err:.0e} / {grad_err:.0e}{verdict}"
    return result


def _kib(n) -> str:
    return f"{n / 1024:.1f}"


def _counted(counter: dict) -> str:
    return "; ".join(f"{n}x {what}" for what, n in counter.items())


def markdown(rows: list[dict]) -> str:
    lines = ["| idiom | ranks | status | params / rank (KiB) | ideal (KiB) | over ideal "
             "| per layer fwd/bwd | derived bound | Megatron bound | bytes over bound "
             "| outside layers | not as expected | gathers / fallbacks | numerics out / grad |",
             "|---|---:|---|---:|---:|---:|---|---|---|---:|---|---|---|---|"]
    for r in rows:
        if "per_layer" not in r:  # no plan at all
            lines.append(f"| {r['idiom']} | {r['world_size']} | {r['status']} |  |  |  |  |  "
                         f"| {r['megatron_bound']} |  |  |  |  | {r.get('numerics', '-')} |")
            continue
        wrong = "; ".join(sorted(r["not_as_expected"])) or "-"
        extra = "; ".join(filter(None, (_counted(r["gathers"]), _counted(r["fallbacks"])))) or "-"
        lines.append(
            f"| {r['idiom']} | {r['world_size']} | {r['status']} | "
            f"{_kib(r['param_bytes_max_rank'])} | {_kib(r['param_bytes_ideal'])} | "
            f"{r['over_ideal']:+.1%} | {r['per_layer']} | {r['derived_bound']} | "
            f"{r['megatron_bound']} | {_over(r)} | {r['outside_layers']} | {wrong} | {extra} | "
            f"{r.get('numerics', '-')} |")
    return "\n".join(lines)


def _over(r: dict) -> str:
    """The bytes the plan's collectives carry beyond the bound's ('?': sizes the data decides)."""
    over = r.get("bytes_over_bound")
    return "?" if over is None else f"{over:+,}"


def _matches(r: dict) -> bool:
    """The Megatron plan: its styles, its bytes, its collectives and nothing else."""
    return (r["status"].startswith("ok") and r["at_megatron_bound"] and not r["not_as_expected"]
            and not r.get("kept_whole") and not r.get("bytes_over_bound")
            and r["over_ideal"] < 0.005 and _numerics_ok(r))


def _numerics_ok(r: dict) -> bool:
    """Not measured, or within the tolerance."""
    return "numerics" not in r or (r["numerics"][0].isdigit() and "MISMATCH" not in r["numerics"])


def details(rows: list[dict]) -> str:
    """For every idiom and world size off the Megatron plan: the planner's reasons."""
    out = []
    for r in rows:
        if "per_layer" not in r:
            out.append(f"- **{r['idiom']}**, {r['world_size']} ranks: {r['status']}")
        elif not _matches(r):
            out.append(f"- **{r['idiom']}**, {r['world_size']} ranks: {r['per_layer']} per layer "
                       f"(Megatron {r['megatron_bound']}, derived from the model "
                       f"{r['derived_bound']}), {r['over_ideal']:+.1%} parameter bytes, "
                       f"{_over(r)} bytes of collectives beyond the bound's")
            if not r["status"].startswith("ok"):
                out.append(f"  - {r['status']}")
            out += [f"  - `{k}`: {why}" for k, why in sorted(r["not_as_expected"].items())]
            out += [f"  - {n}x fallback {k}" for k, n in r["fallbacks"].items()]
            if not _numerics_ok(r):
                out.append(f"  - on gloo ranks: {r['numerics']}")
    return "\n".join(out)


DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"
START, END = "<!-- idiom-table:start -->", "<!-- idiom-table:end -->"


def support_table(rows: list[dict]) -> str:
    """One row per idiom for docs/models.md: how it is written, and per world size whether the
    plan is Megatron's (collectives per layer forward / backward, bytes over the ideal)."""
    sizes = sorted({r["world_size"] for r in rows})
    lines = ["| idiom | written as | " + " | ".join(f"{ws} ranks" for ws in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    by = {(r["idiom"], r["world_size"]): r for r in rows}
    for name in idioms.IDIOMS:
        cells = []
        for ws in sizes:
            r = by[name, ws]
            if "per_layer" not in r:
                cells.append(r["status"])
                continue
            verdict = "Megatron's plan" if _matches(r) else "off the plan"
            cells.append(f"{verdict}: {r['per_layer']} AR ({_over(r)} bytes), "
                         f"{r['over_ideal']:+.0%} parameter bytes, {r.get('numerics', 'not run')}")
        lines.append(f"| `{name}` | {idioms.STYLES[name]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write_docs(table: str) -> None:
    text = DOCS.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    DOCS.write_text(f"{text[:a]}\n{table}\n{text[b:]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(idioms.IDIOMS), help="one idiom")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--numerics", action="store_true",
                        help="also compare with the unsharded model on local gloo ranks")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else list(idioms.IDIOMS)
    rows = []
    for name in names:
        for ws in args.world_sizes:
            rows.append(measure(name, ws))
            print(f"[{rows[-1]['seconds']:5.1f}s] {name} ws {ws}: {rows[-1]['status']}",
                  file=sys.stderr, flush=True)
    if args.numerics:
        for ws in args.world_sizes:
            errors = numerics(names, ws)
            for r in rows:
                if r["world_size"] == ws:
                    r["numerics"] = errors[r["idiom"]]
            print(f"numerics on {ws} gloo ranks done", file=sys.stderr, flush=True)
    table = markdown(rows)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": BATCH, "seq": SEQ, "torch": torch.__version__,
                                               "rows": rows}, indent=1))
    if not args.only and args.numerics:
        matching = sum(_matches(r) for r in rows)
        (RESULTS / "idioms.md").write_text(
            f"`{COMMAND}` (torch {torch.__version__}, batch {BATCH}, seq {SEQ}, float32; "
            f"zoo/idioms, plans from `tpcompile.explain`, no process group).\n\n"
            f"{matching} of {len(rows)} rows are the Megatron plan: expected styles, bytes at "
            f"the ideal, all-reduces at the bound carrying the bound's bytes (where the data "
            f"does not decide a size), no other collective, and the unsharded "
            f"model's numbers (relative error <= {TOLERANCE:g}).\n\n{table}\n\n"
            f"## Where a plan is not Megatron's, and the planner's reasons\n\n{details(rows)}\n")
        _write_docs(support_table(rows))


if __name__ == "__main__":
    main()
