"""Real scale beyond planning: issue #47's items 2-4, each measured and judged in one run.

    python -m bench.realscale --all     # planning (bench/realscale.py), then the three below

- **checkpoint**: ``bench/generation_checkpoint.py`` on the Llama-3.2-1B-shaped checkpoint
  (saved once in ``--dir``), 2 gloo ranks: ``from_pretrained`` seconds (config, meta model,
  ``parallelize`` and the load), the first call of ``generate`` against a repeated one (first
  token, ``max_new_tokens=1``), peak RSS per rank against the weights' bytes, tokens equal to
  the unsharded model's.
- **step**: ``bench/step_time.py`` at real width (dim 2048, 32 / 8 heads, hidden 8192, 2 layers,
  1 x 128 tokens), 2 ranks: DTensor's ``parallelize_module`` and tpcompile, eager and compiled,
  and the unsharded step, whose time / N plus tpcompile's collectives replayed alone is the
  ideal.
- **compile**: ``bench/compile_time.py`` at 2 and 16 layers (its dim-256 Llama), one cold
  round: tpcompile's first compiled step (``torch.compile(tp)`` with compiled blocks) against
  DTensor's compiled model.

Each measure is judged against the issue's target; :func:`judged` returns the rows
``bench/realscale.py`` writes to its results file.
"""

from __future__ import annotations

import argparse

from tpcompile.tools.launch import run_on_ranks

STEP = dict(dim=2048, heads=32, kv_heads=8, hidden=8192, layers=2, batch=1, seq=128, steps=10)
STEP_VARIANTS = ("dtensor eager", "dtensor compiled", "tpcompile eager", "tpcompile compiled",
                 "unsharded")
DEPTHS = (2, 16)


def _row(item: str, measure: str, value: float, unit: str, op: str = "",
         target: float = 0.0) -> dict:
    """One measure; judged against ``op target`` (``"<="`` or ``">="``) unless ``op`` is empty."""
    met = None if not op else (value <= target if op == "<=" else value >= target)
    return {"item": item, "measure": measure, "value": value, "unit": unit,
            "target": f"{op} {target:g}{unit}" if op else "", "met": met}


def checkpoint(directory: str) -> list[dict]:
    """From a checkpoint directory to the first token, and the memory a rank holds."""
    from bench import generation_checkpoint as gc

    result = gc.run(directory, gc.LLAMA_1B, 2)
    ranks, reference = result["ranks"], result["reference"]
    worst = {k: max(r[k] for r in ranks) for k in ("parallelize_s", "load_s", "ttft_first_s",
                                                   "ttft_repeated_s", "peak_rss")}
    weights = reference["params"] * 4  # float32
    same = all(r["tokens"] == reference["tokens"] for r in ranks)
    return [
        _row("checkpoint", "from_pretrained (meta model, parallelize, load) s",
             worst["parallelize_s"] + worst["load_s"], " s", "<=", 6.0),
        _row("checkpoint", "first generate call / repeated call (first token)",
             worst["ttft_first_s"] / worst["ttft_repeated_s"], "x", "<=", 2.0),
        _row("checkpoint", "peak RSS per rank / the weights' bytes",
             worst["peak_rss"] / weights, "x", "<=", 0.65),
        _row("checkpoint", "greedy tokens equal the unsharded model's", float(same), "", ">=",
             1.0),
    ]


def step() -> list[dict]:
    """The training step at real width: tpcompile against DTensor and against the ideal."""
    from dataclasses import asdict

    from bench import step_time

    cfg = step_time.Config(**STEP, only=",".join(STEP_VARIANTS))
    s = step_time.summarize(run_on_ranks(f"{step_time.__file__}:rank_main", 2, asdict(cfg),
                                          timeout=3600))
    ideal = s["tpcompile eager"]["ideal_ms"]
    return [
        _row("step", "DTensor eager step / tpcompile eager step",
             s["dtensor eager"]["step_ms"] / s["tpcompile eager"]["step_ms"], "x", ">=", 1.2),
        _row("step", "tpcompile eager step / ideal", s["tpcompile eager"]["step_ms"] / ideal, "x",
             "<=", 1.10),
        _row("step", "tpcompile compiled step / ideal",
             s["tpcompile compiled"]["step_ms"] / ideal, "x", "<=", 1.05),
        _row("step", "DTensor eager step / ideal (no target: what the lead can be)",
             s["dtensor eager"]["step_ms"] / ideal, "x"),
    ]


def compile_depth() -> list[dict]:
    """The first compiled step against depth, cold caches: tpcompile over DTensor."""
    from bench import compile_time

    cfg = {"model": "llama", "batch": 4, "seq": 128, "repeats": 1, "layers": list(DEPTHS),
           "variants": ["dtensor compiled", "tpcompile compiled"]}
    rows = compile_time.summarize(run_on_ranks(f"{compile_time.__file__}:rank_main", 2, cfg,
                                                timeout=7200))
    at = {(r["variant"], r["layers"]): r["first_step_s"] for r in rows}
    return [_row("compile", f"tpcompile / DTensor first compiled step, {d} layers",
                 at["tpcompile compiled", d] / at["dtensor compiled", d], "x", "<=", 1.0)
            for d in DEPTHS]


def judged(directory: str) -> list[dict]:
    """Every row of the three measurements, in the order of the issue."""
    return checkpoint(directory) + step() + compile_depth()


def markdown(rows: list[dict]) -> str:
    lines = ["| item | measure | value | target | verdict |", "|---|---|---:|---|---|"]
    for r in rows:
        verdict = "" if r["met"] is None else ("met" if r["met"] else "missed")
        lines.append(f"| {r['item']} | {r['measure']} | {r['value']:.2f}{r['unit']} | "
                     f"{r['target']} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/tpcompile-llama-1b")
    print(markdown(judged(p.parse_args(argv).dir)))


if __name__ == "__main__":
    main()
