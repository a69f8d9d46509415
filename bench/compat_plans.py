"""Print the plans of the built-in models, for comparing torch releases (bench/compat.sh).

For each built-in model at 2 and 4 ranks, with and without sequence parallelism, it prints
``explain``'s plan as stable JSON: every parameter's style, sharded dim, local shapes and gradient sync, every collective
(op, phase, shape, the captured value it converts), what was kept replicated and every
fallback, and nothing that depends on timing. Two torch releases that capture the same ATen
graph must print the same text; ``bench/compat.sh`` diffs each release's output against the
first release it runs.

    python -m bench.compat_plans > plans.json
"""

from __future__ import annotations

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
    report = tpcompile.explain(model, models.example_inputs(model), world_size, **options)
    return {
        "params": {fqn: [p.style, p.dim, p.local_shapes, p.grad_sync]
                   for fqn, p in sorted(report.params.items())},
        "collectives": [[c.op, c.phase, list(c.shape), c.node, c.layer]
                        for c in report.collectives],
        "kept_replicated": [[k["node"], k["reason"]] for k in report.kept_replicated],
        "fallbacks": [[f["node"], f["reason"]] for f in report.fallbacks],
    }


def main() -> None:
    out = {f"{name} ws{ws}{' sp' if opts else ''}": plan_summary(name, ws, opts)
           for name, ws, opts in CASES}
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
