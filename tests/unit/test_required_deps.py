"""CI's ``TPCOMPILE_REQUIRE_TEST_DEPS=1`` gate (tests/conftest.py) covers every dependency a
test skips without: each name a test passes to ``pytest.importorskip`` or
``importlib.util.find_spec`` is in the gate's list, the list is installed by the test extra,
and the gate fails the run (not skips) when any one of them cannot be imported. Proved by
faking each import's failure, never by uninstalling a package.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# the guarantees' dependencies issue #37 names: OpInfo soundness (expecttest), the Hugging Face
# rows, LoRA, torchao's quantized weights, the property tests
NAMED = ("expecttest", "transformers", "peft", "torchao", "hypothesis")


def _gate():
    spec = importlib.util.spec_from_file_location("tests_conftest_gate", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _skipped_without() -> dict[str, str]:
    """Module name -> the test file that skips (or drops a case) when it is missing."""
    found = {}
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None)
                    in ("importorskip", "find_spec") and node.args
                    and isinstance(node.args[0], ast.Constant)):
                found[node.args[0].value] = str(path.relative_to(ROOT))
    return found


def test_every_skipping_import_is_required():
    required = set(_gate().REQUIRED)
    found = _skipped_without()
    assert {"transformers", "peft", "torchao"} <= set(found), found  # the scan sees them
    bench = set(_extra_names("bench"))  # the bench extra's libraries: their tests are -m slow
    assert {n: f for n, f in found.items() if n not in required | bench} == {}
    assert set(NAMED) <= required


def _extra_names(extra: str) -> list[str]:
    specs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"][extra]
    return [re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0] for spec in specs]


def test_required_packages_are_in_the_test_extra():
    installed = set(_extra_names("test"))
    for name in _gate().REQUIRED:
        top = name.split(".")[0]
        assert top == "torch" or top in installed, (name, installed)


@pytest.mark.parametrize("missing", _gate().REQUIRED)
def test_gate_fails_when_one_is_missing(missing, monkeypatch):
    gate, real = _gate(), importlib.import_module

    def fake(name, *args, **kwargs):
        if name == missing:
            raise ImportError(f"faked: no {name}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(gate.importlib, "import_module", fake)
    monkeypatch.setenv("TPCOMPILE_REQUIRE_TEST_DEPS", "1")
    with pytest.raises(pytest.UsageError, match=re.escape(missing)):
        gate.pytest_configure(None)
    monkeypatch.setenv("TPCOMPILE_REQUIRE_TEST_DEPS", "0")
    gate.pytest_configure(None)  # not required: the run goes on and the tests skip
