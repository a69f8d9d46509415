"""explain's and diff's pages in a real browser: Debian's chromium, driven by playwright.

What only a browser can tell: the page does not overflow 1400 px, the code columns really get
their half of the width, the SVG is laid out with a box per weight of the block, and nothing
is logged to the console. A screenshot of each page is left in the test's tmp_path.

Skipped where chromium or playwright is absent (``pip install -e '.[browser]'`` and
``apt-get install chromium``); CI installs both (``.ci/run``). No browser is downloaded:
playwright drives the system's ``/usr/bin/chromium`` through ``executable_path``.
"""

from __future__ import annotations

import os
import shutil

import pytest

import tpcompile
from tpcompile.tools import models

pytestmark = pytest.mark.browser


def _missing(what: str):
    """Skip, or fail where the browser is required (CI sets TPCOMPILE_REQUIRE_BROWSER=1)."""
    if os.environ.get("TPCOMPILE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"TPCOMPILE_REQUIRE_BROWSER=1 but {what}", pytrace=False)
    pytest.skip(what, allow_module_level=True)


try:
    from playwright import sync_api
except ImportError:
    _missing("no playwright (pip install -e '.[browser]')")
CHROMIUM = os.environ.get("TPCOMPILE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    _missing(f"no chromium at {CHROMIUM} (apt-get install chromium)")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
WIDTH = 1400


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    model = models.build("llama")
    inputs = models.example_inputs(model)
    folder = tmp_path_factory.mktemp("pages")
    out = {"explain": folder / "explain.html", "diff": folder / "diff.html"}
    out["explain"].write_text(tpcompile.explain(model, inputs, 8, html=True))
    out["diff"].write_text(tpcompile.diff(model, inputs, 2, html=True))
    n_block = sum(1 for name, _ in model.named_parameters() if name.startswith("layers.0."))
    return out, n_block


def _open(browser, path):
    page = browser.new_page(viewport={"width": WIDTH, "height": 900})
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("request", lambda r: problems.append(f"request {r.url}")
            if not r.url.startswith(("file:", "data:", "about:")) else None)
    page.goto(path.as_uri())
    return page, problems


def _no_page_overflow(page):
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    assert page.evaluate("document.body.scrollWidth") <= WIDTH


def test_explain_page(browser, pages, tmp_path):
    (paths, n_block) = pages
    page, problems = _open(browser, paths["explain"])
    _no_page_overflow(page)
    svg = page.locator("svg.plan")
    assert svg.count() == 1
    box = svg.bounding_box()
    assert box["width"] > 0.5 * WIDTH and box["height"] > 300
    assert page.locator("svg.plan g.block g.box").count() == n_block
    assert page.locator("svg.plan g.block g.collective").count() > 0
    # every box is drawn inside the picture, its label readable (not clipped to nothing)
    for i in range(n_block):
        b = page.locator("svg.plan g.block g.box rect").nth(i).bounding_box()
        assert b["width"] > 60 and box["x"] <= b["x"] and b["x"] + b["width"] <= box["x"] + box["width"]
    page.screenshot(path=str(tmp_path / "explain.png"), full_page=True)
    assert (tmp_path / "explain.png").stat().st_size > 10_000
    assert problems == []
    page.close()


def test_diff_page(browser, pages, tmp_path):
    (paths, _) = pages
    page, problems = _open(browser, paths["diff"])
    _no_page_overflow(page)
    sides = page.locator(".pair .side")
    assert sides.count() == 2
    for i in range(2):
        width = sides.nth(i).bounding_box()["width"]
        assert width >= 0.4 * WIDTH, width
    # long lines scroll inside their column instead of wrapping: one line, one row's height
    line = page.locator(".pair .side").nth(1).locator(".l.collective").first
    assert line.bounding_box()["height"] <= 18
    assert page.evaluate("(() => { const s = document.querySelectorAll('.pair .side')[1];"
                         " return s.scrollWidth > s.clientWidth; })()")
    # a folded run opens on a click, in both columns
    fold = page.locator("label.fold").first
    target = fold.get_attribute("for")
    hidden = page.locator(f".folded.{target}")
    assert hidden.count() == 2 and not hidden.first.is_visible()
    fold.click()
    assert hidden.first.is_visible() and hidden.nth(1).is_visible()
    # the jump list leads to a rewritten node
    link = page.locator("ul.jump a").first
    anchor = link.get_attribute("href")
    link.click()
    assert page.locator(anchor).is_visible()
    page.screenshot(path=str(tmp_path / "diff.png"), full_page=True)
    assert (tmp_path / "diff.png").stat().st_size > 10_000
    assert problems == []
    page.close()
