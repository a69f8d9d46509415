"""The package's layers: every import inside tpcompile goes down (or within its own layer).

The layers, and why in that order, are declared once in the package (:mod:`tpcompile.layers`);
a module importing upwards would let stage 1 depend on stage 4: this test names the first
such import. No module imports another's private names either.
"""

import ast
from pathlib import Path

import pytest

import tpcompile
import tpcompile.passes
from tpcompile.layers import layer_modules

LAYERS = layer_modules()


def layer_of(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def modules():
    for root, prefix in [(Path(tpcompile.__file__).parent, "tpcompile"),
                         (Path(tpcompile.passes.__file__).parent, "tpcompile.passes")]:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if name == "tpcompile" or (prefix == "tpcompile" and parts[:1] == ["passes"]):
                continue  # the package root re-exports every layer; passes/ is walked separately
            yield name, path


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno


@pytest.mark.parametrize("name,path", list(modules()), ids=lambda x: str(x).rsplit("/", 1)[-1])
def test_imports_go_down(name, path):
    mine = layer_of(name)
    assert mine is not None, f"{name} belongs to no layer; add it to LAYERS in tpcompile/layers.py"
    for target, line in imports(path):
        theirs = layer_of(target)
        if target.startswith("tpcompile") and theirs is None and target != "tpcompile":
            pytest.fail(f"{path.name}:{line} imports {target}, which belongs to no layer")
        assert target != "tpcompile", f"{path.name}:{line} imports the package root"
        if theirs is not None:
            assert theirs <= mine, f"{path.name}:{line}: {name} (layer {mine}) imports {target} (layer {theirs})"


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore is its module's own: what another module needs is
    public (in ``__all__`` where the module keeps one), so a module's API is what it exports."""
    reach_ins = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (
                    node.module or "").startswith("tpcompile")):
                reach_ins += [f"{path.name}:{node.lineno} imports {a.name} from {node.module}"
                              for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert reach_ins == []


def test_few_modules_at_the_top():
    top = [p.name for p in Path(tpcompile.__file__).parent.glob("*.py")]
    assert len(top) <= 12, top
