"""Generate the maps of the code the docs carry, from the code itself.

    python docs/generate.py            # rewrite them in place
    python docs/generate.py --check    # exit 1, naming the stale files, if any is out of date

What it writes, each between its ``<!-- NAME:start -->`` / ``<!-- NAME:end -->`` markers:

- README.md ``pipeline``: the "How it works" table, one row per step of
  ``tpcompile.passes.pipeline.steps()`` in the order they run.
- docs/design.md ``pipeline``: the same steps as a block; ``planner``: what ``plan_sharding``
  does in order (propagate, each stage of ``refine.REFINEMENTS``, freeze with its ``ABSORB``
  steps, then ``refine.FINISH``); and ``layout``: every module of the package, in the order of
  the layers ``tpcompile/layers.py`` declares (tests/unit/test_layers.py checks that imports
  go down them).

A step's, a refinement's or a module's summary is the first sentence of its module's docstring,
so a pass is described where it is written (each pass and each refinement is a file named after
it); a step of freeze or of ``FINISH`` is summed up by its function's docstring.
tests/unit/test_generated_docs.py fails when a file is stale.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from pathlib import Path

from tpcompile.layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
# the layout block's parts: the package root (it re-exports every layer), then the layers
LAYOUT = ["tpcompile/__init__.py"] + [part for layer in LAYERS for part in layer
                                      if part != "passes/__init__.py"]
WIDTH, COLUMN = 100, 30


def summary(path: Path) -> str:
    """The first sentence of a module's docstring (of a package's ``__init__.py``), as Markdown."""
    if path.is_dir():
        path = path / "__init__.py"
    return first_sentence(ast.get_docstring(ast.parse(path.read_text())) or "")


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, as Markdown."""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", sentence.replace("``", "`"))


def _file(fn) -> str:
    return str(Path(inspect.getsourcefile(inspect.unwrap(fn))).resolve().relative_to(ROOT))


def planner_block() -> str:
    """``plan_sharding``'s steps in order: what each refinement stage and finishing step does."""
    from tpcompile.passes.planner import freeze, propagate, refine

    lines = _entry("propagate", f"{summary(ROOT / _file(propagate.propagate))} "
                                f"({_file(propagate.propagate)})")
    for i, (stage, fns) in enumerate(refine.REFINEMENTS, 1):
        for fn in fns:
            lines += _entry(f"{i} {stage}: {fn.__name__}", f"{summary(ROOT / _file(fn))} ({_file(fn)})")
    steps = [("freeze", fn) for fn in freeze.ABSORB] + [("freeze", freeze.freeze)] + [
        ("finish", fn) for fn in refine.FINISH]
    for phase, fn in steps:
        lines += _entry(f"{phase}: {fn.__name__}",
                        f"{first_sentence(inspect.getdoc(fn) or '')} ({_file(fn)})")
    return "```\n" + "\n".join(lines) + "\n```"


def step_rows() -> list[tuple[str, str, str]]:
    """``(step, file, summary)`` for each step of the pipeline, in order."""
    from tpcompile.passes import pipeline

    rows = []
    for name, fn in pipeline.steps():
        path = Path(inspect.getsourcefile(inspect.unwrap(fn))).resolve().relative_to(ROOT)
        rows.append((name, str(path), summary(ROOT / path)))
    return rows


def readme_table() -> str:
    lines = ["| step | file | what it does |", "|---|---|---|"]
    lines += [f"| `{name}` | `{path}` | {text} |" for name, path, text in step_rows()]
    return "\n".join(lines)


def _entry(label: str, text: str) -> list[str]:
    """``label`` padded to the block's second column, ``text`` wrapped beside it."""
    wrapped = textwrap.wrap(text, WIDTH - COLUMN) or [""]
    first = label.ljust(COLUMN - 1) + " " + wrapped[0] if len(label) < COLUMN else label
    rest = wrapped[1:] if len(label) < COLUMN else wrapped
    return [first] + [" " * COLUMN + line for line in rest]


def pipeline_block() -> str:
    lines = []
    for name, path, text in step_rows():
        lines += _entry(name, f"{text} ({path})")
    return "```\n" + "\n".join(lines) + "\n```"


def _modules(folder: Path, depth: int) -> list[str]:
    """One entry per module and sub-package of ``folder``, sub-packages expanded below theirs."""
    lines = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".py" and path.name != "__init__.py":
            lines += _entry("  " * depth + path.name, summary(path))
        elif path.is_dir() and (path / "__init__.py").exists():
            lines += _entry("  " * depth + path.name + "/", summary(path))
            lines += _modules(path, depth + 1)
    return lines


def layout_block() -> str:
    covered = set()
    lines = []
    for part in LAYOUT:
        path = ROOT / part
        lines += _entry(part + ("/" if path.is_dir() else ""), summary(path))
        if path.is_dir():
            lines += _modules(path, 1)
            covered |= set(path.rglob("*.py"))
        covered.add(path)
    every = {p for root in ("tpcompile", "passes") for p in (ROOT / root).rglob("*.py")}
    missing = sorted(str(p.relative_to(ROOT)) for p in every - covered
                     if p != ROOT / "passes" / "__init__.py")
    if missing:
        raise SystemExit(f"docs/generate.py: {missing} are in no part of LAYOUT; add them")
    return "```\n" + "\n".join(lines) + "\n```"


def generated() -> dict[str, dict[str, str]]:
    """file -> marker name -> the text between its markers."""
    return {"README.md": {"pipeline": readme_table()},
            "docs/design.md": {"pipeline": pipeline_block(), "planner": planner_block(),
                               "layout": layout_block()}}


def rendered(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each marked block replaced."""
    for name, body in blocks.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        head, sep, tail = text.partition(start)
        if not sep or end not in tail:
            raise SystemExit(f"docs/generate.py: no {start} ... {end} markers")
        text = head + start + "\n" + body + "\n" + end + tail.split(end, 1)[1]
    return text


def stale() -> list[str]:
    """The files whose generated blocks differ from what the code says now."""
    return [name for name, blocks in generated().items()
            if rendered((ROOT / name).read_text(), blocks) != (ROOT / name).read_text()]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        files = stale()
        if files:
            print(f"stale: {', '.join(files)}; run `python docs/generate.py`")
        return 1 if files else 0
    for name, blocks in generated().items():
        path = ROOT / name
        path.write_text(rendered(path.read_text(), blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
