"""The side-by-side HTML page of a :class:`~tpcompile.inspect.diff.GraphDiff`.

One self-contained file (inline CSS, no script, no external resource) that a reviewer can open
from a CI artifact: before on the left, after on the right, lines aligned by ``difflib``;
each line is coloured by the placement of the value it defines (sharded, partial sums,
inserted collective), added / removed / changed lines are marked, and a list at the top names
every inserted collective with its op, phase, shape and bytes.
"""

from __future__ import annotations

import difflib
from html import escape

__all__ = ["page"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
code, td.code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
table.diff { border-collapse: collapse; width: 100%; table-layout: fixed; }
table.diff td { padding: 0 .4em; vertical-align: top; white-space: pre-wrap; word-break: break-all; }
td.n { width: 3em; color: #888; text-align: right; }
td.mark { width: 1em; font-weight: bold; }
.shard { background: #dceeff; }
.partial { background: #ffe9cc; }
.collective { background: #ffd0d0; font-weight: bold; }
.ins { border-left: 3px solid #2a2; }
.del { border-left: 3px solid #c22; }
.chg { border-left: 3px solid #c80; }
span.key { padding: 0 .5em; margin-right: .5em; }
"""

_MARK = {"insert": ("", "+"), "delete": ("-", ""), "replace": ("~", "~"), "equal": ("", "")}
_EDGE = {"insert": "ins", "delete": "del", "replace": "chg", "equal": ""}


def _var(line: str) -> str:
    return line.strip().split(" = ", 1)[0]


def _cell(line: str | None, number: int | None, edge: str, mark: str, view) -> str:
    if line is None:
        return '<td class="n"></td><td class="mark"></td><td class="code"></td>'
    var = _var(line)
    kind = "collective" if var in view.inserted else view.placements.get(var, "")
    classes = " ".join(c for c in ("code", kind, edge) if c)
    return (f'<td class="n">{number}</td><td class="mark">{mark}</td>'
            f'<td class="{classes}">{escape(line)}</td>')


def _table(before: str, after: str, view) -> list[str]:
    a, b = before.splitlines(), after.splitlines()
    rows = ['<table class="diff">', "<thead><tr><th colspan=\"3\">before</th>"
            "<th colspan=\"3\">after</th></tr></thead>", "<tbody>"]
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        left_mark, right_mark = _MARK[op]
        for k in range(max(i2 - i1, j2 - j1)):
            i, j = i1 + k, j1 + k
            left = _cell(a[i] if i < i2 else None, i + 1, _EDGE[op], left_mark, view)
            right = _cell(b[j] if j < j2 else None, j + 1, _EDGE[op], right_mark, view)
            rows.append(f"<tr>{left}{right}</tr>")
    return rows + ["</tbody>", "</table>"]


def _collective_list(diff) -> list[str]:
    if not diff.collectives:
        return ["<p>No collectives inserted.</p>"]
    items = []
    for c in diff.collectives:
        size = f"{c.bytes:,} bytes" if c.bytes is not None else "size unknown"
        items.append(f"<li><code>{escape(c.inserted_as)}</code>: {escape(c.phase)} "
                     f"<code>{escape(c.op)}</code> after <code>{escape(c.node)}</code> "
                     f"({escape(c.module or 'top level')}), "
                     f"{escape('x'.join(map(str, c.shape)))} {escape(c.dtype)}, {size}</li>")
    return ["<ul>"] + items + ["</ul>"]


class _View:
    """What the cells need: placements by variable name and the inserted collectives' names."""

    def __init__(self, diff):
        self.placements = diff.placements
        self.inserted = {c.inserted_as for c in diff.collectives}


def page(diff, passes: bool | None = None) -> str:
    view = _View(diff)
    title = f"tpcompile diff: {diff.model}, rank {diff.rank} of {diff.world_size}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{escape(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        f"<h1>{escape(title)}</h1>",
        '<p><span class="key shard">sharded (Shard)</span><span class="key partial">partial '
        'sums (Partial)</span><span class="key collective">inserted collective</span>'
        '<span class="key ins">added</span><span class="key del">removed</span>'
        '<span class="key chg">changed</span>replicated values are not coloured</p>',
        "<h2>Inserted collectives</h2>", *_collective_list(diff),
        "<h2>Rewritten shape constants</h2>",
        f"<p>{escape(', '.join(diff.relocalized) or 'none')}</p>",
    ]
    for name, before, after in diff.pairs(passes):
        parts += [f"<h2>{escape(name)}</h2>", *_table(before, after, view)]
    return "\n".join(parts + ["</body>", "</html>"]) + "\n"
