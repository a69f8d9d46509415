"""The screenshots in docs/images/ show the plan the tool writes today: docs/make_screenshots.py
records each picture's plan status (the verdict against the bound, the collectives per phase)
in docs/images/status.json when it takes them, and this test recomputes that status for the
same model. A change to the planner or the bound that the pictures do not show fails here
until `python docs/make_screenshots.py` is run again (CI regenerates them and compares too).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _make_screenshots():
    spec = importlib.util.spec_from_file_location("make_screenshots", DOCS / "make_screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pictures_show_todays_plan():
    shown = json.loads((DOCS / "images" / "status.json").read_text())
    today = _make_screenshots().status()
    assert set(shown) == {"explain", "diff"}
    for page, status in today.items():
        assert shown[page] == status, (page, shown[page], status)
    assert today["explain"]["verdict"].startswith("at the bound")
