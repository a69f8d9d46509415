"""The diffusers summary line of docs/models.md and the README is
bench/results/diffusers_sweep.json's, recomputed from its rows (bench/diffusers_sweep.py's
``summary``), and every class that plans but is not at the bound is named in docs/models.md:
typed-in counts would drift from the sweep they quote.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.diffusers_sweep import summary

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[dict]:
    return json.loads((ROOT / "bench/results/diffusers_sweep.json").read_text())["rows"]


def test_docs_summary_line_is_the_results_files():
    """docs/models.md and the README quote it."""
    results = (ROOT / "bench/results/diffusers_sweep.md").read_text().splitlines()[0]
    line = summary(_rows())
    assert line == results, (line, results)
    for page in ("docs/models.md", "README.md"):
        assert line in " ".join((ROOT / page).read_text().split()), (page, line)


def test_docs_name_every_planned_class_off_the_bound():
    section = (ROOT / "docs/models.md").read_text().split("## diffusers models")[1]
    off = [r["family"] for r in _rows() if "per_layer" in r and r["status"] != "at bound"]
    missing = [name for name in off if f"`{name}`" not in section]
    assert not missing, missing
