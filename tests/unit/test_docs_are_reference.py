"""docs/ and the README state what is true of the current code, not how it got there.

History (earlier counts, the changes that moved them, A/Bs against old commits) lives in
bench/results/HISTORY.md; measured tables stay in docs/ with their command and machine. This
test names the first line that narrates instead (a work log's "this stop", "the stop before",
who else used the machine) and a README test count that would change with every commit.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NARRATION = re.compile(
    r"\b(this|last|that|same|a later|an earlier|the) stop\b|\bthe stop before\b"
    r"|\b(before|after|in|during) this (work|session|stop)\b|\bthis session\b"
    r"|\bother engineers\b|\bother sessions\b|\bchangelog\b", re.IGNORECASE)
TEST_COUNT = re.compile(r"\b\d[\d,]* (tests|passed)\b")


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"],
                         ids=lambda p: p.name)
def test_no_narration(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        found = NARRATION.search(line)
        assert found is None, f"{path.name}:{number}: {found.group(0)!r} narrates: {line.strip()}"


def test_the_readme_gives_no_test_count():
    found = TEST_COUNT.search((ROOT / "README.md").read_text())
    assert found is None, f"README.md gives a test count, {found.group(0)!r}: say what runs instead"
