"""The Hugging Face sweep's report (bench/results/hf_sweep.md): the summary, the misses by
category, one row per family and the planner's reasons where a family is not at the bound.
"""

from __future__ import annotations

import re
from collections import Counter

from bench.hf_configs import HEADS, HIDDEN, INTER, LAYERS, VOCAB
from bench.hf_numerics import TOLERANCE
from bench.hf_verdict import classify, fold, in_block, totals

COMMAND = "nice -n 19 python -m bench.hf_sweep --numerics --jobs 2"

# Observed between runs of the same sweep, not in one row: numerics on gloo ranks raised
# PlanMismatchError ("ranks planned differently") for BeamForCausalLM, Gemma3ForCausalLM and
# Gemma3ForConditionalGeneration in one run and were exact in the other (each flipped).
NOTES = (
    "- **Plans differ between ranks, not every run**: `PlanMismatchError: ranks planned "
    "differently` on the 2 gloo ranks for BeamForCausalLM and Gemma3ForConditionalGeneration "
    "in one full run, for ModernBertDecoderForCausalLM and Llama4ForCausalLM in a later one; "
    "each exact when re-run (the last two and Gemma3ForConditionalGeneration in four re-runs "
    "each, PYTHONHASHSEED 1-3 giving the same plan). Not reproduced outside a full sweep under "
    "load; a numerics error now keeps the whole message (`detail`), which names each rank's "
    "first differing entry. Rows below are the last run's.",
)



def _kib(n) -> str:
    return f"{n / 1024:.1f}"


def merge_rows(old: list[dict], fresh: list[dict]) -> list[dict]:
    """``old`` (a full sweep's rows) with each family of ``fresh`` in place of its row, new
    families last."""
    by_family = {r["family"]: r for r in fresh}
    return [by_family.pop(r["family"], r) for r in old] + list(by_family.values())


def numerics_cell(r) -> str:
    n = r.get("numerics")
    if not n:
        return "-"
    if "error" in n:
        return n["error"][:120]
    if "float64_grad_err" in n:  # a float32 miss run again in float64
        verdict = ("exact in float64" if n["exact"] else "MISMATCH in float64") + \
            f" ({n['float64_grad_err']:.0e}; unsharded float32 vs float64: " \
            f"{n['float32_rounding']:.0e})"
    else:
        verdict = "exact" if n["exact"] else f"MISMATCH ({fold(n['worst_grad'])})" + (
            f"; no float64 run: {n['float64_error'][:80]}" if "float64_error" in n else "")
    return f"{n['output_err']:.0e} / {n['max_grad_err']:.0e} {verdict}"


def _fold_reason(text: str) -> str:
    """A planner reason without node numbers, model lines and module paths: what to count."""
    text = re.sub(r"\([^()]*\.py:\d+[^()]*\)", "", text)       # (module, file.py:123)
    text = re.sub(r"/\S+/site-packages/transformers/models/(\w+)/\S+", r"<\1>", text)
    text = re.sub(r"(?<=[a-z_])_\d+\b", "", text)              # matmul_5 -> matmul
    text = re.sub(r"\b\d+\b", "N", text)
    return re.sub(r"\s+", " ", text).strip()


def category(r) -> str:
    """The reason a family is not at the bound, folded for counting."""
    s = r["status"]
    if s == "at bound":
        if r.get("numerics") and not r.get("exact"):
            cell = re.sub(r"\d+e-\d+ / \d+e-\d+ MISMATCH.*", "MISMATCH above 1e-5",
                          numerics_cell(r))
            return "at bound, numerics off: " + re.sub(r";.*| the first entry.*", "",
                                                       _fold_reason(cell))[:110]
        return ""
    if s in ("not built", "not captured", "tpcompile error", "tpcompile internal error",
             "crash", "timeout", "skipped"):
        why = _fold_reason(r.get("why", ""))
        for _ in range(3):  # the model line and node names, nested parentheses too
            why = re.sub(r"\s*\([^()]*\)", "", why)
        why = why.split("; ")[0]
        why = re.sub(r" at node \S+", "", why)
        why = re.sub(r"(writes into) \S+ (.*?); \S+ (is placed)", r"\1 a view \2; it \3", why)
        return f"{s}: {why[:140]}"
    if s == "bound undecided":
        return f"{s}: {r['undecided'][0].split(': ', 1)[-1]}"
    over = r.get("bytes_over_bound") or 0
    if s == "below bound":
        return f"{s}: the derived bound misjudges the model (fewer " + (
            "bytes" if over < 0 and _counted_alike(r) else "all-reduces") + " run than it counts)"
    if s == "above bound" and over > 0 and _counted_alike(r) and not r["gathers"]:
        return f"{s}: the bound's all-reduces, carrying more bytes than its"
    if s == "not sharded":
        return "not sharded: " + (_fold_reason(next(iter(sorted(r["not_sharded"].values())), ""))
                                  [:140] or "no column -> row chain found")
    if r["fallbacks"]:
        return f"{s}: fallback, {_fold_reason(next(iter(r['fallbacks'])))[:120]}"
    if r["gathers"]:
        return f"{s}: {_fold_reason(next(iter(r['gathers'])))}"
    if r["not_sharded"]:
        return (f"{s}: weights Megatron shards left replicated, "
                f"{_fold_reason(sorted(r['not_sharded'].values())[0])[:140]}")
    synced = [g.rsplit(".", 2)[-2] + "." + g.rsplit(".", 1)[-1] for g in r.get("grad_synced", [])
              if in_block(g)]
    if synced:
        return (f"{s}: backward all-reduce per replicated weight in a layer "
                f"({', '.join(sorted(set(synced)))})")
    if r["outside_layers"] != "-":
        return f"{s}: collectives outside the layers"
    return s


def _counted_alike(r) -> bool:
    """As many all-reduces as the bound, over the layers and around them."""
    return all(totals(r, k) == totals(r, f"bound_{k}") for k in ("forward", "backward"))


def _reclassify(rows) -> None:
    for r in rows:
        if "per_layer" in r:
            r["status"] = classify(r)


def counts(rows) -> dict[str, int]:
    """The sweep's headline counts (the README's sentence is checked against these)."""
    at = [r for r in rows if r["status"] == "at bound"]
    return {"built": sum(r["status"] not in ("not built", "skipped") for r in rows),
            "captured": sum(bool(r.get("captured")) for r in rows),
            "planned": sum("per_layer" in r for r in rows),
            "at": len(at), "exact": sum(bool(r.get("exact")) for r in at)}


def summary(rows, n_found) -> tuple[str, Counter]:
    n = counts(rows)
    numerics_run = any("numerics" in r for r in rows)
    misses = Counter(r["status"] for r in rows if r["status"] != "at bound")
    text = (f"**{n_found} causal-LM families found, {n['built']} built at the tiny config, "
            f"{n['captured']} captured, {n['planned']} planned, {n['at']} at Megatron's bound"
            + (f", {n['exact']} of them exact on 2 gloo ranks" if numerics_run else "")
            + ".** Misses: " + ", ".join(f"{n} {s}" for s, n in misses.most_common()) + ".")
    return text, Counter(category(r) for r in rows if category(r))


def report_markdown(rows, meta, n_found) -> str:
    _reclassify(rows)
    head, cats = summary(rows, n_found)
    lines = [head, "",
             f"`{COMMAND}` (torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['world_size']} ranks, ids {meta['batch']} x {meta['seq']}, float32, train "
             f"mode, dropout 0; hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, intermediate "
             f"{INTER}, vocab {VOCAB}). Generated by bench/hf_sweep.py; plans from "
             f"`tpcompile.explain`, no process group; numerics on gloo ranks "
             f"(`tpcompile.tools.numerics.compare`, tolerance {TOLERANCE:g})."
             + (f" Plans and bound judged again on {meta['rejudged']} (`python -m "
                "bench.hf_sweep --rejudge`): a row keeps the numerics of the full run only "
                "where its plan is unchanged." if meta.get("rejudged") else "")
             + (f" {meta['merged']['families']} families measured again on "
                f"{meta['merged']['date']} (`--only ... --merge"
                f"{' --numerics' if meta['merged']['numerics'] else ''}`), their rows replaced."
                if meta.get("merged") else ""), "",
             "## Misses by category", "",
             "| category | families | examples |", "|---|---:|---|"]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        if category(r):
            by_cat.setdefault(category(r), []).append(r["family"])
    for cat, n in cats.most_common():
        ex = ", ".join(by_cat[cat][:4]) + (", ..." if n > 4 else "")
        lines.append(f"| {cat.replace('|', '/')} | {n} | {ex} |")
    lines += ["", "## Notes", "", *NOTES]
    lines += ["", "## Families", "",
              "| family | captured (why not) | params / rank (KiB) | ideal (KiB) | over ideal "
              "| per layer fwd/bwd | Megatron bound | outside layers | gathers / fallbacks "
              "| numerics out / grad | status |",
              "|---|---|---:|---:|---:|---|---|---|---|---|---|"]
    for r in rows:
        why = r.get("why", "").replace("|", "/")[:160]
        if "per_layer" not in r:
            cap = "yes" if r.get("captured") else ("no: " + why if r["status"] == "not captured"
                                                   else "-")
            status = r["status"] + ("" if r["status"] == "not captured" else f": {why}")
            lines.append(f"| {r['family']} | {cap} |  |  |  |  |  |  |  |  | {status} |")
            continue
        extra = "; ".join(f"{n}x {k}" for k, n in {**r["gathers"], **r["fallbacks"]}.items())
        status = r["status"] + (", exact" if r.get("exact") else "")
        lines.append(
            f"| {r['family']} | yes{' (static shapes)' if r.get('static_shapes') else ''} | "
            f"{_kib(r['param_bytes_max_rank'])} | {_kib(r['param_bytes_ideal'])} | "
            f"{r['over_ideal']:+.1%} | {r['per_layer']} | {r['megatron_bound']} | "
            f"{r['outside_layers']} | {extra.replace('|', '/')[:300] or '-'} | "
            f"{numerics_cell(r).replace('|', '/')} | {status} |")
    lines += ["", "## Not at the bound: the planner's reasons", ""]
    for r in rows:
        if "per_layer" in r and r["status"] != "at bound":
            lines.append(f"- **{r['family']}** ({r['status']}): {r['per_layer']} per layer "
                         f"(Megatron {r['megatron_bound']}), outside layers "
                         f"{r['outside_layers']}, {r['over_ideal']:+.1%} parameter bytes")
            lines += [f"  - `{k}`: {why}" for k, why in sorted(r["not_sharded"].items())][:6]
            lines += [f"  - {n}x fallback {k}" for k, n in r["fallbacks"].items()][:6]
            lines += [f"  - {n}x {k}" for k, n in r["gathers"].items()][:6]
        elif r["status"] in ("tpcompile error", "tpcompile internal error"):
            lines.append(f"- **{r['family']}** ({r['status']}, {r.get('stage', '')}): "
                         f"`{r.get('why', '')}`")
    return "\n".join(lines) + "\n"
