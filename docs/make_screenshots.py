"""Regenerate the screenshots in docs/images/ from the pages tpcompile writes today.

    pip install -e '.[browser]'; apt-get install chromium   # Debian's browser, no download
    python docs/make_screenshots.py                           # writes docs/images/*.png
    python docs/make_screenshots.py --out /tmp/images         # CI: regenerated, status compared

The pages are those of the built-in Llama (2 layers, 8 query / 2 KV heads): ``explain`` at 8
ranks (its KV heads are replicated inside the attention, so the picture shows every style
but vocabulary-parallel) and ``diff`` at 2 ranks. Screenshots are taken in headless chromium
at 1400 px, the width tests/browser checks. Beside them, ``status.json`` records what each
picture shows of the plan (the verdict against the bound, the collectives per phase):
tests/unit/test_screenshots.py fails when the tool would write another status for the same
model today, and CI regenerates the pictures and compares this file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import tpcompile
from tpcompile.inspect.traffic import bound_verdict
from tpcompile.tools import models

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
WIDTH = 1400


PAGES = {"explain": 8, "diff": 2}  # page -> the world size it is drawn at


def status() -> dict:
    """What each picture shows of the built-in Llama's plan, as the tool writes it today."""
    model = models.build("llama")
    inputs = models.example_inputs(model)
    out = {}
    for page, world_size in PAGES.items():
        report = tpcompile.explain(model, inputs, world_size)
        out[page] = {"model": "llama", "world_size": world_size,
                     "verdict": bound_verdict(report.megatron),
                     "collectives": dict(sorted(Counter(
                         f"{c.phase} {c.op}" for c in report.collectives).items()))}
    return out


def pages(folder: Path) -> dict[str, Path]:
    model = models.build("llama")
    inputs = models.example_inputs(model)
    out = {"explain": folder / "explain.html", "diff": folder / "diff.html"}
    out["explain"].write_text(tpcompile.explain(model, inputs, PAGES["explain"], html=True))
    out["diff"].write_text(tpcompile.diff(model, inputs, PAGES["diff"], html=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        html = pages(Path(tmp))
        browser = p.chromium.launch(executable_path=args.chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
        page.goto(html["explain"].as_uri())
        page.screenshot(path=str(args.out / "explain.png"), full_page=True)
        page.goto(html["diff"].as_uri())
        # the columns of code from their heading down, one fold opened to show the toggle
        page.locator("label.fold").nth(1).click()
        top = page.locator(".pair").first.bounding_box()["y"] + page.evaluate("window.scrollY")
        page.screenshot(path=str(args.out / "diff.png"), full_page=True,
                        clip={"x": 0, "y": top - 50, "width": WIDTH, "height": 1100})
        browser.close()
    (args.out / "status.json").write_text(json.dumps(status(), indent=1) + "\n")
    for name in ("explain.png", "diff.png", "status.json"):
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
