"""``experts="auto"`` against the measured step times of ``python -m bench.experts``.

Reads the newest ``bench/results/experts-*.json`` (no numbers copied here): for every measured
row (shape, ranks), what ``experts="auto"`` plans now for the bench's block must be the row's
measured faster cut wherever the margin (the median per-round difference of the interleaved
steps) exceeds the spread (its interquartile range); and the results file's ``auto`` column
must be what the code plans now, so the committed table is this cost model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _newest() -> dict:
    files = sorted(RESULTS.glob("experts-*.json"))
    assert files, "no bench/results/experts-*.json: run python -m bench.experts"
    return json.loads(files[-1].read_text())


ROWS = _newest()["rows"]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['shape']}-{r['world_size']}" for r in ROWS])
def test_auto_picks_the_measured_faster_cut_beyond_the_spread(row):
    from bench.experts import _auto_pick

    pick = _auto_pick(row["shape"], row["world_size"])
    assert pick == row["auto"], (pick, row["auto"])
    if row["margin_ms"] > row["spread_ms"]:
        assert pick == row["measured_winner"], row
