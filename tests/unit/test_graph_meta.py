"""The metadata keys the library writes onto graphs and nodes: torch's own, and its marks.

What a pass finds is returned as a value (a pass record's ``facts``, a function's result), not
left in ``gm.meta`` or ``node.meta`` for another module to read: a key written here is one more
way for passes to talk past their signatures. The scan reads the source of tpcompile/ and
passes/ for every key assigned into a ``.meta`` (by subscript, ``update``, ``setdefault`` or a
dict literal) and compares the set with the ones the library means to write.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tpcompile
import tpcompile.passes

# torch's own keys the passes set on nodes they make (a key copied from another node's meta
# under the same name, ``copy.meta.setdefault(key, call.meta[key])``, is no new key)
TORCH = {"val"}
# the library's own: the checkpoint region mark capture puts on each node (core.checkpoint_marks)
MARKS = {"REGION"}


def _key(node: ast.expr) -> str:
    return node.value if isinstance(node, ast.Constant) else ast.unparse(node)


def _written(tree: ast.AST):
    """Every key assigned into some ``x.meta`` in ``tree``."""
    def is_meta(e) -> bool:
        return isinstance(e, ast.Attribute) and e.attr == "meta"

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and is_meta(t.value):
                    yield _key(t.slice)
                elif is_meta(t) and isinstance(node.value, ast.Dict):
                    yield from (_key(k) for k in node.value.keys if k is not None)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and is_meta(node.func.value) and node.args):
            copied = (len(node.args) == 2 and isinstance(node.args[1], ast.Subscript)
                      and is_meta(node.args[1].value)
                      and _key(node.args[1].slice) == _key(node.args[0]))
            if node.func.attr == "setdefault" and not copied:
                yield _key(node.args[0])
            elif node.func.attr == "update" and isinstance(node.args[0], ast.Dict):
                yield from (_key(k) for k in node.args[0].keys if k is not None)


def test_the_library_writes_only_torchs_keys_and_its_marks():
    roots = [Path(tpcompile.__file__).parent, Path(tpcompile.passes.__file__).parent]
    written = {}
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        for key in _written(ast.parse(path.read_text())):
            written.setdefault(key, path.name)
    assert {k: where for k, where in written.items() if k not in TORCH | MARKS} == {}
    assert MARKS <= set(written)  # each mark is still written (else drop it from the list)
