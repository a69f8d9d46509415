"""docs/guarantees.md's claim -> test table covers every number of the README: each number in
the README's prose (outside the demo's output block, which ``tpcompile demo`` checks, and the
support table, which tests/unit/test_support_table.py recomputes) must appear in the "README
claim" column of that table, so a new number cannot land without its guard being named. The
transformers sweep's counts in the README are checked against the sweep's results file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.hf_report import counts

ROOT = Path(__file__).resolve().parents[2]
# a number: 37, 2,500, 1e-5, 0.58x, 92%, 2.13 (not a digit inside a word like "H100" or "7B")
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:e-\d+)?[x%]?(?!\w)")
# numbers that name something rather than claim it, each with where it stands
NAMES = {"0": "rank 0's rewritten graph"}


def _prose(text: str) -> str:
    """The README without fenced blocks, table rows, code spans and link targets."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("|"):
            out.append(re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", line)))
    return "\n".join(out)


def _claims() -> str:
    """The first column of guarantees.md's "Every number of the README" table."""
    text = (ROOT / "docs/guarantees.md").read_text()
    section = text.split("## Every number of the README", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "README claim" not in r]
    assert len(rows) >= 10, rows
    return "\n".join(r.split("|")[1] for r in rows)


def test_every_readme_number_has_a_row():
    readme = set(NUMBER.findall(_prose((ROOT / "README.md").read_text())))
    assert {"1e-5", "10.6%"} <= readme, readme  # the extraction sees the claims
    missing = sorted(readme - set(NUMBER.findall(_claims())) - set(NAMES))
    assert not missing, f"README numbers with no row in docs/guarantees.md's table: {missing}"


def test_readme_sweep_counts_are_the_results_files():
    """The README's transformers-sweep sentence is read off bench/results/hf_sweep.json (the
    sweep's own rows, judged against the derived bound), not typed in."""
    data = json.loads((ROOT / "bench/results/hf_sweep.json").read_text())
    n = counts(data["rows"])
    version = ".".join(data["transformers"].split(".")[:2])
    readme = " ".join((ROOT / "README.md").read_text().split())
    for claim in (f"Of the {n['captured']} causal-LM families of transformers {version}",
                  f"{n['at']} ({round(100 * n['at'] / n['captured'])}%) are planned at "
                  "Megatron's bound",
                  f"{n['exact']} of them are exact on 2 gloo ranks"):
        assert claim in readme, claim


def test_readme_real_scale_figures_are_the_results_files():
    """The README's real-scale planning times and workload ratios are bench/realscale's rows,
    as measured."""
    data = json.loads((ROOT / "bench/results/realscale-2026-12-07-all.json").read_text())
    seconds = {r["shape"]: r["total_s"] for r in data["rows"] if r["reuse"] and r["world_size"] == 8
               and r["layers"] in (32, 80, 126)}
    value = {r["measure"]: r["value"] for r in data["workloads"]}
    rss = value["peak RSS per rank / the weights' bytes"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    for claim in (f"{seconds['8B']:.2f} s for 8B, {seconds['70B']:.2f} s for 70B and "
                  f"{seconds['405B']:.2f} s for 405B",
                  f"peaks at {rss:.2f}x the weights'",
                  f"takes {value['from_pretrained (meta model, parallelize, load) s']:.2f} s",
                  f"the first `generate` "
                  f"{value['first generate call / repeated call (first token)']:.2f}x",
                  f"is {value['tpcompile eager step / ideal']:.2f}x the ideal eager and "
                  f"{value['tpcompile compiled step / ideal']:.2f}x compiled"):
        assert claim in readme, claim
