"""Print the plans of the built-in models, for comparing torch releases (bench/compat.sh).

For each built-in model at 2 and 4 ranks, with and without sequence parallelism, it prints
``explain``'s plan as stable JSON: every parameter's style, sharded dim, local shapes and gradient sync, every collective
(op, phase, shape, the captured value it converts), what was kept replicated and every
fallback, and nothing that depends on timing. Two torch releases that capture the same ATen
graph must print the same text; ``bench/compat.sh`` diffs each release's output against the
first release it runs.

``--corpus`` adds the idiom corpus (zoo/idioms, as bench/idioms.py builds it) and the
transformers families CI plans (bench/hf_sweep.py's ``REPRESENTATIVE``) at 2 and 4 ranks, each
without sequence parallelism: the snapshot a refactor of the planner diffs before and after
(about 8 minutes on one thread).

    python -m bench.compat_plans > plans.json
    python -m bench.compat_plans --corpus > plans-all.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import tpcompile
from tpcompile.tools import models

CASES = [(name, ws, options) for name in ("mlp", "gpt2", "llama") for ws in (2, 4)
         for options in ({}, {"sequence_parallel": True})]


def plan_summary(name: str, world_size: int, options: dict) -> dict:
    """The timing-free part of ``explain``'s report for one built-in model."""
    torch.manual_seed(0)
    model = models.build(name)
    return summary(model, models.example_inputs(model), world_size, options)


def summary(model, inputs: tuple, world_size: int, options: dict) -> dict:
    """The timing-free part of ``explain``'s report for ``model``, or the error it raised."""
    try:
        report = tpcompile.explain(model, inputs, world_size, **options)
    except Exception as e:  # noqa: BLE001 - a refusal is part of the plan
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "params": {fqn: [p.style, p.dim, p.local_shapes, p.grad_sync, p.reason]
                   for fqn, p in sorted(report.params.items())},
        "collectives": [[c.op, c.phase, list(c.shape), c.node, c.layer]
                        for c in report.collectives],
        "kept_replicated": [[k["node"], k["reason"]] for k in report.kept_replicated],
        "fallbacks": [[f["node"], f["reason"]] for f in report.fallbacks],
    }


def corpus() -> dict:
    """Every idiom and every CI transformers family at 2 and 4 ranks."""
    from bench import hf_sweep
    from zoo import idioms

    out = {}
    for ws in (2, 4):
        for name in idioms.IDIOMS:
            out[f"idiom {name} ws{ws}"] = summary(idioms.build(name), idioms.example_inputs(name=name),
                                                  ws, {})
        for name in hf_sweep.REPRESENTATIVE:
            out[f"hf {name} ws{ws}"] = summary(hf_sweep.build(name), (hf_sweep.example_ids(),),
                                               ws, {})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="store_true",
                        help="also the idiom corpus and the CI transformers families")
    args = parser.parse_args(argv)
    out = {f"{name} ws{ws}{' sp' if opts else ''}": plan_summary(name, ws, opts)
           for name, ws, opts in CASES}
    if args.corpus:
        out.update(corpus())
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
