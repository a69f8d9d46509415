"""The side-by-side HTML page of a :class:`~tpcompile.inspect.diff.diff.GraphDiff`.

One self-contained file (inline CSS, no script, no external resource) that a reviewer can open
from a CI artifact: before on the left, after on the right, each column half the page wide,
lines aligned by ``difflib`` and never wrapped (a long line scrolls inside its column, the line
numbers stay put). Each line is coloured by the placement of the value it defines (sharded,
partial sums, inserted collective) and added / removed / changed lines are marked. Runs of
unchanged lines are folded behind a toggle (a checkbox and CSS: no script), and a jump list
at the top links every node the rewrite changed.
"""

from __future__ import annotations

import difflib
from html import escape

__all__ = ["page"]

CONTEXT = 3   # unchanged lines kept visible next to a change
FOLD_MIN = 8  # a shorter unchanged run is shown whole

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1em 1.2em; color: #222; }
code, .side { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.pair { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 8px;
        margin-bottom: 2em; }
.side { overflow-x: auto; border: 1px solid #ddd; border-radius: 6px; }
.side h3 { font-family: system-ui, sans-serif; font-size: 14px; margin: 0; padding: .3em .6em;
           background: #f4f4f4; position: sticky; left: 0; }
.lines { display: inline-block; min-width: 100%; }
.l { white-space: pre; line-height: 17px; height: 17px; padding-right: 1em; }
.n { display: inline-block; width: 4.5em; padding-right: .6em; text-align: right; color: #888;
     background: #fafafa; position: sticky; left: 0; }
.m { display: inline-block; width: 1.2em; font-weight: bold; }
.shard { background: #dceeff; }
.partial { background: #ffe9cc; }
.collective { background: #ffd0d0; font-weight: bold; }
.ins { box-shadow: inset 3px 0 #2a2; }
.del { box-shadow: inset 3px 0 #c22; }
.chg { box-shadow: inset 3px 0 #c80; }
.blank { background: repeating-linear-gradient(45deg, #fff, #fff 4px, #f3f3f3 4px, #f3f3f3 8px); }
input.fold { display: none; }
label.fold { display: block; height: 17px; line-height: 17px; color: #555; background: #eef2f7;
             cursor: pointer; padding-left: 5.7em; white-space: pre; }
.folded { display: none; }
span.key { padding: 0 .5em; margin-right: .5em; }
ul.jump { columns: 3 18em; font-size: 13px; }
"""

_MARK = {"insert": ("", "+"), "delete": ("-", ""), "replace": ("~", "~"), "equal": ("", "")}
_EDGE = {"insert": "ins", "delete": "del", "replace": "chg", "equal": ""}


def _var(line: str) -> str:
    return line.strip().split(" = ", 1)[0]


class _View:
    """What the lines need: placements by variable name and the inserted collectives' names."""

    def __init__(self, diff):
        self.placements = diff.placements
        self.inserted = {c.inserted_as for c in diff.collectives}

    def kind(self, line: str) -> str:
        var = _var(line)
        return "collective" if var in self.inserted else self.placements.get(var, "")


def _line(text: str | None, number: int | None, edge: str, mark: str, view: _View,
          anchor: str = "") -> str:
    if text is None:
        return '<div class="l blank"><span class="n"></span></div>'
    classes = " ".join(c for c in ("l", view.kind(text), edge) if c)
    ident = f' id="{escape(anchor)}"' if anchor else ""
    return (f'<div class="{classes}"{ident}><span class="n">{number}</span>'
            f'<span class="m">{mark}</span>{escape(text)}</div>')


class _Columns:
    """The two columns of one diff being built, and the folds and jump targets in it."""

    def __init__(self, key: str, view: _View):
        self.key, self.view = key, view
        self.left: list[str] = []
        self.right: list[str] = []
        self.folds: list[str] = []
        self.jumps: list[tuple[str, str, str]] = []   # (anchor, variable, kind)

    def rows(self, a, b, op, i1, i2, j1, j2) -> None:
        left_mark, right_mark = _MARK[op]
        for k in range(max(i2 - i1, j2 - j1)):
            i, j = i1 + k, j1 + k
            anchor = ""
            if op != "equal" and j < j2 and " = " in b[j]:
                anchor = f"{self.key}-{_var(b[j])}"
                self.jumps.append((anchor, _var(b[j]), self.view.kind(b[j]) or _EDGE[op]))
            self.left.append(_line(a[i] if i < i2 else None, i + 1, _EDGE[op], left_mark, self.view))
            self.right.append(_line(b[j] if j < j2 else None, j + 1, _EDGE[op], right_mark,
                                    self.view, anchor))

    def fold(self, a, b, i1, i2, j1, j2) -> None:
        """An unchanged run: its middle behind a toggle both columns share."""
        if i2 - i1 < FOLD_MIN:
            return self.rows(a, b, "equal", i1, i2, j1, j2)
        head, tail = CONTEXT if i1 else 0, CONTEXT if i2 < len(a) else 0
        self.rows(a, b, "equal", i1, i1 + head, j1, j1 + head)
        fold = f"{self.key}-fold{len(self.folds)}"
        self.folds.append(fold)
        hidden = i2 - tail - i1 - head
        label = f'<label class="fold" for="{fold}">\u22ef {hidden} unchanged lines (show / hide)</label>'
        for side in (self.left, self.right):
            side += [label, f'<div class="folded {fold}">']
        self.rows(a, b, "equal", i1 + head, i2 - tail, j1 + head, j2 - tail)
        for side in (self.left, self.right):
            side.append("</div>")
        self.rows(a, b, "equal", i2 - tail, i2, j2 - tail, j2)

    def html(self, title: str) -> list[str]:
        toggles = [f'<input type="checkbox" class="fold" id="{f}">' for f in self.folds]
        return ['<div class="pair">', *toggles,
                '<div class="side"><h3>before</h3><div class="lines">', *self.left, "</div></div>",
                f'<div class="side"><h3>after ({escape(title)})</h3><div class="lines">',
                *self.right, "</div></div>", "</div>"]


def _columns(before: str, after: str, key: str, view: _View) -> _Columns:
    a, b = before.splitlines(), after.splitlines()
    cols = _Columns(key, view)
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            cols.fold(a, b, i1, i2, j1, j2)
        else:
            cols.rows(a, b, op, i1, i2, j1, j2)
    return cols


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


def _jump_list(sections: list[tuple[str, _Columns]]) -> list[str]:
    out = ["<h2>Rewritten nodes</h2>"]
    for title, cols in sections:
        links = [f'<li><a href="#{escape(anchor)}" class="{kind}"><code>{escape(var)}</code></a></li>'
                 for anchor, var, kind in cols.jumps]
        head = f"<p>{escape(title)}:</p>" if len(sections) > 1 else ""
        out += [head, '<ul class="jump">', *links, "</ul>"] if links else [head, "<p>none</p>"]
    return out


def page(diff, passes: bool | None = None) -> str:
    view = _View(diff)
    title = f"tpcompile diff: {diff.model}, rank {diff.rank} of {diff.world_size}"
    sections = [(name, _columns(before, after, f"d{i}", view))
                for i, (name, before, after) in enumerate(diff.pairs(passes))]
    fold_css = "".join(f"#{f}:checked ~ .side .{f} {{ display: block; }}\n"
                       for _, cols in sections for f in cols.folds)
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{escape(title)}</title>", f"<style>{_CSS}{fold_css}</style>", "</head>", "<body>",
        f"<h1>{escape(title)}</h1>",
        '<p><span class="key shard">sharded (Shard)</span><span class="key partial">partial '
        'sums (Partial)</span><span class="key collective">inserted collective</span>'
        '<span class="key ins">added</span><span class="key del">removed</span>'
        '<span class="key chg">changed</span>replicated values are not coloured; '
        f"unchanged runs of {FOLD_MIN} or more lines are folded (click to show)</p>",
        *_jump_list(sections),
        "<h2>Inserted collectives</h2>", *_collective_list(diff),
        "<h2>Rewritten shape constants</h2>",
        f"<p>{escape(', '.join(diff.relocalized) or 'none')}</p>",
    ]
    for name, cols in sections:
        parts += [f"<h2>{escape(name)}</h2>", *cols.html(name)]
    return "\n".join(parts + ["</body>", "</html>"]) + "\n"
