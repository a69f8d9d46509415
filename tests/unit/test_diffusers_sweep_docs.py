"""docs/models.md's diffusers summary line is bench/results/diffusers_sweep.json's, recomputed
from its rows (bench/diffusers_sweep.py's ``summary``), and every class that plans but is not
at the bound is named there: typed-in counts would drift from the sweep they quote.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.diffusers_sweep import summary

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[dict]:
    return json.loads((ROOT / "bench/results/diffusers_sweep.json").read_text())["rows"]


def test_docs_summary_line_is_the_results_files():
    docs = " ".join((ROOT / "docs/models.md").read_text().split())
    results = (ROOT / "bench/results/diffusers_sweep.md").read_text().splitlines()[0]
    line = summary(_rows())
    assert line == results, (line, results)
    assert line in docs, line


def test_docs_name_every_planned_class_off_the_bound():
    section = (ROOT / "docs/models.md").read_text().split("## diffusers models")[1]
    off = [r["family"] for r in _rows() if "per_layer" in r and r["status"] != "at bound"]
    missing = [name for name in off if f"`{name}`" not in section]
    assert not missing, missing
