"""The wheel ships every subpackage: pyproject's ``packages`` list names each folder of
``tpcompile/`` and ``passes/`` that holds an ``__init__.py`` (through the ``package-dir`` mapping),
and nothing else. An editable install imports from the checkout and never notices a missing
entry; the wheel CI installs does, at import (``No module named tpcompile.passes.planner.experts``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _on_disk() -> set[str]:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = set()
    for package, folder in {"tpcompile": "tpcompile", **setup["package-dir"]}.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join((package, *parts)))
    return names


def test_every_package_folder_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setup["packages"]) == _on_disk()
