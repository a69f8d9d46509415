"""Regenerate the screenshots in docs/images/ from the pages tpcompile writes today.

    pip install -e '.[browser]'; apt-get install chromium   # Debian's browser, no download
    python docs/make_screenshots.py                           # writes docs/images/*.png

The pages are those of the built-in Llama (2 layers, 8 query / 2 KV heads): ``explain`` at 8
ranks (its KV heads are replicated inside the attention, so the picture shows every style
but vocabulary-parallel) and ``diff`` at 2 ranks. Screenshots are taken in headless chromium
at 1400 px, the width tests/browser checks.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

import tpcompile
from tpcompile.tools import models

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
WIDTH = 1400


def pages(folder: Path) -> dict[str, Path]:
    model = models.build("llama")
    inputs = models.example_inputs(model)
    out = {"explain": folder / "explain.html", "diff": folder / "diff.html"}
    out["explain"].write_text(tpcompile.explain(model, inputs, 8, html=True))
    out["diff"].write_text(tpcompile.diff(model, inputs, 2, html=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
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
    for name in ("explain", "diff"):
        print(f"wrote {args.out / (name + '.png')}")


if __name__ == "__main__":
    main()
