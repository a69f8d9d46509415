"""Test helpers importable from every test file (``pythonpath`` in pyproject names tests/).

The rank-side bodies live in ``gloo/workers.py``, which spawned ranks import by file path; this
module loads the same file so tests can parametrize over its case table.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tpcompile.tools.launch import run_on_ranks

WORKERS_PATH = str(Path(__file__).parent / "gloo" / "workers.py")
_spec = importlib.util.spec_from_file_location("tpcompile_test_workers", WORKERS_PATH)
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)


def launch(function: str, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``workers.<function>(rank, world_size, *args)`` on gloo ranks; per-rank results."""
    return run_on_ranks(f"{WORKERS_PATH}:{function}", world_size, *args, timeout=timeout)


class LaunchedOnDemand(dict):
    """key (a world size, or what one launch covers) -> ``run(key)``, run the first time a
    test asks: a launch whose tests are all marked slow does not run in CI."""

    def __init__(self, run):
        super().__init__()
        self.run = run

    def __missing__(self, key):
        self[key] = self.run(key)
        return self[key]


def cases(results: dict, world_size: int, name) -> list:
    """Every rank's result for case ``name``; a case that raised on a rank fails the test."""
    per_rank = [r[name] for r in results[world_size]]
    for c in per_rank:
        assert "error" not in c, c.get("error")
    return per_rank


def rewrite_ranks(model, example_inputs, world_size: int, **options):
    """Plan once, rewrite every rank's copy of the graph: (plan, fingerprint entries, graphs).

    What ``parallelize`` does on each rank, without a process group; the entries are what the
    ranks compare (see tpcompile.runtime.agreement), one list per rank.
    """
    from tpcompile.core.plan import PlanOptions
    from tpcompile.passes import pipeline
    from tpcompile.runtime.agreement import collective_entries, plan_entries

    planned = pipeline.plan(model, example_inputs, world_size, options=PlanOptions(**options))
    plan = planned.plan
    shared = plan_entries(planned.cap, plan)
    entries, graphs = [], []
    for rank in range(world_size):
        gm, _ = pipeline.rewrite(planned, rank, "tp")
        entries.append(shared + collective_entries(gm))
        graphs.append(gm)
    return plan, entries, graphs
