"""A planned family's verdict against Megatron's bound derived from the model (bench/hf_sweep.py,
bench/upstream.py).

The bound is :mod:`tpcompile.inspect.bound.bound`'s, as ``tpcompile.explain`` reports it: per layer
the all-reduces Megatron pays forward and backward, the weights it splits (``whole``: those the
plan keeps whole), the weights it could not judge (``undecided``) and the parameter bytes per
rank of its plan (``param_bytes_ideal``). Nothing here counts collectives of its own.

*status*: ``at bound`` (per layer no more all-reduces than the bound and over the model, the
code around the layers included, exactly as many, carrying as many bytes
(``bytes_over_bound``, not compared where the data decides a size), every layer the bound
charges paying at least one forward, nothing gathered, no fallback, no
weight the bound splits kept whole, the largest rank within 1% of the ideal bytes), ``below
bound`` (all of that but fewer all-reduces or bytes than the bound: the bound misjudged the
model, a row to fix in :mod:`tpcompile.inspect.bound.bound`), ``above bound`` (more all-reduces
or bytes than the bound, or gathers), ``off bound`` (no more collectives, but weights left whole or bytes over
the ideal), ``bound undecided`` (at the bound for the weights it judged, some not judged),
``not sharded`` (no collective at all). A post-LN layer's input-gradient all-reduce is
counted in the layer before it, or outside the layers for the first (Electra, BERT): the bound
is judged on suffix sums of layers and on the totals with the collectives outside the layers.
"""

from __future__ import annotations

import re
import time
import traceback
import warnings
from collections import Counter

from bench.hf_configs import LAYERS, first_line, get

OVER_IDEAL = 0.01  # the largest rank's parameter bytes may exceed the bound's ideal by this


def in_block(fqn: str) -> bool:
    return re.search(r"(^|\.)\d+\.", fqn) is not None


def fold(name: str) -> str:
    """``layers.3.mlp`` -> ``layers.*.mlp``: one name per repeated module."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def _per_layer(rows, fields) -> str:
    values = ["/".join(str(r[f]) for f in fields) for r in rows]
    return values[0] if len(set(values)) == 1 else ", ".join(values) if values else "-"


def _explain(row: dict, model, inputs: tuple, world_size: int, example_kwargs):
    """(report, None), or (None, the row completed with why ``explain`` failed)."""
    import tpcompile
    from tpcompile.errors import CaptureError, TPCompileError

    stages: list[str] = []
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = tpcompile.explain(model, inputs, world_size, progress=stages.append,
                                      example_kwargs=example_kwargs)
    except Exception as e:  # noqa: BLE001 - a family tpcompile cannot plan is a measurement
        captured = not isinstance(e, CaptureError) and any(
            not s.startswith("capturing") for s in stages)
        internal = not isinstance(e, TPCompileError)
        return None, {**row, "seconds": time.perf_counter() - start, "captured": captured,
                      "status": ("tpcompile internal error" if internal and captured
                                 else "not captured" if not captured else "tpcompile error"),
                      "why": first_line(e), "stage": stages[-1] if stages else "",
                      "trace": traceback.format_exc()[-4000:]}
    row.update(seconds=time.perf_counter() - start, captured=True,
               static_shapes=any("accepts only" in str(w.message) for w in caught))
    return report, row


def plan_row(row: dict, model, inputs: tuple, cfg, world_size: int,
             example_kwargs: dict | None = None) -> dict:
    """``row`` completed with ``model``'s plan at ``world_size`` ranks (``explain``) against the
    derived bound: per-layer collectives and the bound's, parameter bytes against its ideal,
    the weights it splits that the plan keeps whole, those it could not judge, gathers,
    fallbacks and the status (``classify``). ``cfg`` answers ``num_hidden_layers``; a failure
    to plan is the row's status."""
    from tpcompile.inspect.traffic import bytes_over_bound

    report, row = _explain(row, model, inputs, world_size, example_kwargs)
    if report is None:
        return row
    row["param_bytes_max_rank"] = max(report.param_bytes_per_rank)
    row["param_bytes_total"] = report.param_bytes_total
    row["param_bytes_ideal"] = report.param_bytes_ideal
    row["over_ideal"] = row["param_bytes_max_rank"] / row["param_bytes_ideal"] - 1
    layers = [m for m in report.megatron if m.layer]
    outside = [m for m in report.megatron if not m.layer]
    row["layers"] = [{k: getattr(m, k) for k in ("layer", "forward", "backward",
                                                  "bound_forward", "bound_backward")}
                     for m in layers]
    row["per_layer"] = _per_layer(row["layers"], ("forward", "backward"))
    row["megatron_bound"] = _per_layer(row["layers"], ("bound_forward", "bound_backward"))
    row["outside"] = [{k: getattr(m, k) for k in ("forward", "backward", "bound_forward",
                                                  "bound_backward")} for m in outside]
    row["outside_layers"] = _per_layer(row["outside"], ("forward", "backward")) if outside else "-"
    # the collectives' bytes beyond the bound's over the model (None: a size the data decides)
    row["bytes_over_bound"] = bytes_over_bound(report.megatron)
    row["not_sharded"] = {f"{fold(w)}: kept whole (Megatron splits it)": report.params[w].reason
                          for m in report.megatron for w in m.whole if w in report.params}
    row["undecided"] = sorted({fold(u) for m in report.megatron for u in m.undecided})
    row["gathers"] = dict(Counter(f"{c.phase} {c.op} ({fold(c.module) or 'top level'})"
                                  for c in report.collectives if c.op != "all_reduce"))
    row["fallbacks"] = dict(Counter(f"{fold(f['module']) or 'top level'}: {f['reason']}"
                                    for f in report.fallbacks))
    row["collectives"] = dict(Counter(
        f"{c.phase} {c.op} at {fold(c.module) or 'top level'} ({re.sub(r'_[0-9]+$', '', c.node)})"
        for c in report.collectives))
    row["grad_synced"] = sorted({fold(fqn) for fqn, p in report.params.items()
                                 if p.trainable and p.grad_sync and p.style == "replicate"})
    row["kept_replicated"] = sorted({f"{fold(k['module']) or 'top level'}: {k['reason']}"
                                     for k in report.kept_replicated})
    row["n_layers"] = get(cfg, "num_hidden_layers") or LAYERS
    row["status"] = classify(row)
    return row


def classify(row) -> str:
    """A planned family's status from its measured fields (see the module docstring)."""
    layers = row["layers"]
    within = (bool(layers) and _outside_layers_within_bound(row) and not row["gathers"]
              and all(r["forward"] <= r["bound_forward"] and (r["forward"] or not r["bound_forward"])
                      for r in layers)
              and _backward_within_bound(layers)
              and len(layers) >= min(row.get("n_layers", LAYERS), LAYERS))
    if within and not row["fallbacks"] and not row["not_sharded"] \
            and row["over_ideal"] < OVER_IDEAL:
        if row.get("undecided"):
            return "bound undecided"
        if totals(row, "forward") != totals(row, "bound_forward") or \
                totals(row, "backward") != totals(row, "bound_backward"):
            return "below bound"
        over = row.get("bytes_over_bound") or 0  # None: not compared (rows before bytes, too)
        return "at bound" if over == 0 else "above bound" if over > 0 else "below bound"
    if not any(r["forward"] or r["backward"] for r in layers) and row["outside_layers"] == "-":
        return "not sharded"
    return "above bound" if _above(row) else "off bound"


def _backward_within_bound(layers) -> bool:
    """Whether each layer's backward all-reduces, plus those counted in the layer before it,
    are within the bound: a post-LN layer's input is the previous layer's norm, so the
    all-reduce of its input gradient is counted there (``nn.TransformerEncoder``: 3 and 1 for
    Megatron's 2 and 2). Every suffix of layers stays within the suffix of bounds: counts
    only move to earlier layers."""
    done = bound = 0
    for r in reversed(layers):
        done, bound = done + r["backward"], bound + r["bound_backward"]
        if done > bound:
            return False
    return True


def totals(row, key: str) -> int:
    """All-reduces over the layers and around them (``key`` a plan count or a bound's)."""
    return sum(r[key] for r in row["layers"] + row.get("outside", []))


def _outside_layers_within_bound(row) -> bool:
    """Whether the all-reduces outside the layers only moved there from a layer under its bound.

    Post-LN models (BERT, Electra, OpenAI GPT) all-reduce the first layer's input gradient
    where that input is made, after the embeddings (outside every layer), so the first layer
    shows 2/1 and "outside" 0/1: the same count as Megatron's 2/2, attributed to the node in
    front of the layer. The totals over layers and outside must stay within the bound's."""
    return all(totals(row, k) <= totals(row, f"bound_{k}") for k in ("forward", "backward"))


def _above(row) -> bool:
    return any(r["forward"] > r["bound_forward"] for r in row["layers"]) \
        or not _backward_within_bound(row["layers"]) \
        or bool(row["gathers"]) or not _outside_layers_within_bound(row)
