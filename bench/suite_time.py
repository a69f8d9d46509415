"""The test command's wall time, and where it goes: bench/results/suite-<date>.md.

    python -m bench.suite_time            # the README's `python -m pytest`, as CI runs it
    python -m bench.suite_time -n 0       # extra pytest arguments: here one process

Runs the test command in the checkout with a JUnit report, then writes the summary line
pytest printed (passed, skipped, wall seconds) and the seconds each test file took (setup,
call and teardown summed: with two workers, two files run at once, so the files' sum exceeds
the wall time). CI's own time is the `-- tests:` line `.ci/run` prints.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def per_file(junit: Path) -> list[tuple[float, int, str]]:
    """(seconds, tests, module) per test file, largest first."""
    seconds, tests = defaultdict(float), defaultdict(int)
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = ".".join(p for p in parts if not p[:1].isupper())  # a test class's module
        seconds[module] += float(case.get("time", 0))
        tests[module] += 1
    return sorted(((s, tests[m], m) for m, s in seconds.items()), reverse=True)


def report(summary: str, files: list, args: list[str], top: int = 40) -> str:
    import torch

    command = " ".join(["python -m pytest", *args])
    rows = "\n".join(f"| {s:.1f} | {n} | {m} |" for s, n, m in files[:top])
    return (f"# The test command's time, {datetime.date.today()}\n\n"
            f"`{command}` in the checkout (torch {torch.__version__}, Python "
            f"{platform.python_version()}, the machine otherwise idle), by "
            f"`python -m bench.suite_time {' '.join(args)}`:\n**{summary}**\n\n"
            f"Seconds per test file (setup, call and teardown summed), the {top} largest:\n\n"
            f"| seconds | tests | file |\n|---:|---:|---|\n{rows}\n"
            f"| {sum(s for s, _, _ in files):.1f} | {sum(n for _, n, _ in files)} | all |\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="the results file")
    known, extra = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}", *extra],
                             cwd=ROOT, capture_output=True, text=True)
        lines = [ln.strip("= ") for ln in run.stdout.splitlines() if re.search(r" in [\d.]+s", ln)]
        if run.returncode != 0 or not lines:
            sys.exit(f"the test command failed (exit {run.returncode}):\n{run.stdout[-3000:]}")
        text = report(lines[-1], per_file(junit), extra)
    out = known.out or RESULTS / f"suite-{datetime.date.today()}.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
