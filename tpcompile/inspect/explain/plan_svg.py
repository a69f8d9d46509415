"""SVG drawings of a plan: the repeated block as boxes and marks, parameter bytes as bars.

Drawn from a :class:`~tpcompile.inspect.explain.plan_block.BlockView` (never by hand per model): one
row of boxes per step of the flow, coloured by style, joined by a vertical edge; every
collective is a mark on the edge where it runs (a circle forward, a diamond backward) with its
op and size beside it, or a diamond on the box of a weight whose gradient it all-reduces.
Hovering anything shows its details (``<title>``). The page scales the drawing to its width.
"""

from __future__ import annotations

from html import escape

from tpcompile.inspect.explain.plan_block import BlockView, Row

__all__ = ["STYLE_COLOURS", "plan_svg", "bytes_svg", "human_bytes"]

# fill, stroke per style; the page's legend reads the same table
STYLE_COLOURS = {
    "colwise": ("#cfe2ff", "#2f6db5", "column-parallel (Shard out-features)"),
    "rowwise": ("#ffdcb8", "#c2661a", "row-parallel (Shard in-features, output partial)"),
    "vocab": ("#cdebc5", "#3f8a35", "vocabulary-parallel (Shard embedding rows)"),
    "replicate": ("#ececec", "#8a8a8a", "replicated (whole on every rank)"),
}
PHASE_COLOURS = {"forward": "#c62828", "backward": "#1f5fbf"}

WIDTH = 960
BOX_H = 46
MARK_STEP = 17
GAP = 10


def human_bytes(n: int | None) -> str:
    if n is None:
        return "? B"
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def _mark_text(c) -> str:
    return f"{c.phase} {c.op} {human_bytes(c.bytes)}"


def _mark_title(c) -> str:
    shape = "x".join(map(str, c.shape))
    return (f"{c.phase} {c.op} of {shape} {c.dtype} ({c.bytes if c.bytes is not None else '?'} "
            f"bytes) after {c.node} ({c.module or 'top level'}), inserted as {c.inserted_as}")


def _shape_at(c, x: float, y: float) -> str:
    colour = PHASE_COLOURS[c.phase]
    if c.phase == "forward":
        return f'<circle cx="{x}" cy="{y}" r="6" fill="{colour}"/>'
    return (f'<path d="M{x} {y - 7} L{x + 7} {y} L{x} {y + 7} L{x - 7} {y} Z" '
            f'fill="{colour}"/>')


def _edge(x: float, y: float, marks: list) -> tuple[list[str], float]:
    """A vertical edge from ``y`` with its collectives stacked on it; returns (svg, height)."""
    height = 22 + MARK_STEP * len(marks)
    out = [f'<line x1="{x}" y1="{y}" x2="{x}" y2="{y + height}" stroke="#555" '
           f'stroke-width="1.5" marker-end="url(#arrow)"/>']
    for i, c in enumerate(marks):
        my = y + 14 + MARK_STEP * i
        out.append(f'<g class="collective" data-phase="{c.phase}" data-op="{c.op}">'
                   f"<title>{escape(_mark_title(c))}</title>{_shape_at(c, x, my)}"
                   f'<text x="{x + 14}" y="{my + 4}" font-size="12">{escape(_mark_text(c))}</text>'
                   "</g>")
    return out, height


def _fit(text: str, width: float, px: float = 7.2) -> str:
    room = max(int(width / px), 4)
    return text if len(text) <= room else text[: room - 1] + "\u2026"


def _row(row: Row, y: float) -> list[str]:
    n = len(row.boxes)
    w = min(230.0, (WIDTH - 40 - GAP * (n - 1)) / n)
    x0 = (WIDTH - (n * w + GAP * (n - 1))) / 2
    out = []
    for i, box in enumerate(row.boxes):
        x = x0 + i * (w + GAP)
        fill, stroke, _ = STYLE_COLOURS.get(box.style, STYLE_COLOURS["replicate"])
        title = (f"{' + '.join(box.params)}: {box.style}, {box.shapes}; {box.reason}"
                 + (f"; chain {box.chain}" if box.chain else "")
                 + ("; gradient all-reduced" if box.grad_sync else ""))
        out.append(f'<g class="box" data-param="{escape(box.params[0])}" '
                   f'data-style="{escape(box.style)}"><title>{escape(title)}</title>'
                   f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{BOX_H}" rx="6" '
                   f'fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>'
                   f'<text x="{x + w / 2:.1f}" y="{y + 19}" font-size="13" text-anchor="middle" '
                   f'font-weight="600">{escape(_fit(box.label, w))}</text>'
                   f'<text x="{x + w / 2:.1f}" y="{y + 36}" font-size="11" text-anchor="middle" '
                   f'fill="#444">{escape(_fit(box.shapes, w, 6.4))}</text>')
        for j, c in enumerate(row.box_marks.get(box.label, [])):
            out.append(f'<g class="collective" data-phase="{c.phase}" data-op="{c.op}">'
                       f"<title>{escape(_mark_title(c))} (its gradient)</title>"
                       f"{_shape_at(c, round(x + w - 10 - 16 * j, 1), y + 10)}</g>")
        out.append("</g>")
    return out


def plan_svg(view: BlockView) -> str:
    """The flow of ``view``'s sections, the block framed and labelled."""
    x, y = WIDTH / 2, 8.0
    body = [f'<text x="{x}" y="{y + 12}" font-size="12" fill="#555" text-anchor="middle">'
            "input</text>"]
    y += 18
    incoming: list = []
    for section in view.sections:
        incoming = incoming + section.marks_before
        if section.in_block:
            part, h = _edge(x, y, incoming)
            body += part
            y += h + 6
            top, incoming = y, []
            y += 26
            group = ['<g class="block">']
        else:
            group = ['<g class="outside">']
        for i, row in enumerate(section.rows):
            if i or not section.in_block:
                part, h = _edge(x, y, incoming)
                group += part
                y += h
            group += _row(row, y)
            y += BOX_H
            incoming = row.marks_after
        if section.in_block:  # the last row's collectives belong inside the frame
            if incoming:
                part, h = _edge(x, y, incoming)
                group += part
                y += h
                incoming = []
            y += 8
            label = f"{view.block}: drawn once for {len(view.same)} identical layer(s)"
            if view.differing:
                label += f"; {len(view.differing)} differ (listed below)"
            group.insert(1, f'<rect x="12" y="{top}" width="{WIDTH - 24}" height="{y - top}" '
                            f'rx="10" fill="none" stroke="#777" stroke-dasharray="6 4"/>'
                            f'<text x="24" y="{top + 18}" font-size="13" fill="#333">'
                            f"{escape(label)}</text>")
            y += 6
        body += group + ["</g>"]
    part, h = _edge(x, y, incoming)
    body += part
    y += h + 4
    body.append(f'<text x="{x}" y="{y + 10}" font-size="12" fill="#555" text-anchor="middle">'
                "output</text>")
    return _svg(body, y + 20, "plan", "the plan of the repeated block: boxes per weight, "
                "collectives on the edges", ARROW)


ARROW = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
         'markerHeight="7" orient="auto-start-reverse"><path d="M0 0 L10 5 L0 10 z" '
         'fill="#555"/></marker></defs>')


def _svg(body: list[str], height: float, css: str, label: str, defs: str = "") -> str:
    return (f'<svg class="{css}" viewBox="0 0 {WIDTH} {height:.0f}" role="img" '
            f'aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg" '
            'font-family="system-ui, sans-serif">' + defs + "".join(body) + "</svg>")


def bytes_svg(per_rank: list[int], total: int, shown: int = 16) -> str:
    """One bar per rank (the first ``shown``) against the unsharded total and the ideal 1/N."""
    n = len(per_rank)
    left, right, bar_h = 90, 200, 18
    scale = (WIDTH - left - right) / max(total, 1)
    ideal = total / n
    body = []
    rows = list(enumerate(per_rank[:shown]))
    for i, (rank, b) in enumerate(rows):
        y = 24 + i * (bar_h + 6)
        body.append(f'<g class="bar" data-rank="{rank}" data-bytes="{b}">'
                    f"<title>rank {rank}: {b:,} bytes, {b / max(total, 1):.1%} of the model "
                    f"(ideal {1 / n:.1%})</title>"
                    f'<text x="{left - 8}" y="{y + 13}" font-size="12" text-anchor="end">rank {rank}</text>'
                    f'<rect x="{left}" y="{y}" width="{b * scale:.1f}" height="{bar_h}" fill="#7aa6d8"/>'
                    f'<text x="{left + b * scale + 6:.1f}" y="{y + 13}" font-size="12">'
                    f"{escape(human_bytes(b))} ({b / ideal:.2f}x ideal)</text></g>")
    bottom = 24 + len(rows) * (bar_h + 6)
    for at, text, colour in ((ideal, f"ideal 1/{n}: {human_bytes(int(ideal))}", "#2e7d32"),
                             (total, f"unsharded: {human_bytes(total)}", "#555")):
        xx = left + at * scale
        body.append(f'<line x1="{xx:.1f}" y1="16" x2="{xx:.1f}" y2="{bottom}" stroke="{colour}" '
                    f'stroke-dasharray="4 3"/><text x="{xx:.1f}" y="12" font-size="11" '
                    f'text-anchor="middle" fill="{colour}">{escape(text)}</text>')
    if n > shown:
        body.append(f'<text x="{left}" y="{bottom + 14}" font-size="12">... and {n - shown} '
                    f"more ranks (largest: {human_bytes(max(per_rank))})</text>")
        bottom += 18
    return _svg(body, bottom + 8, "bytes", "parameter bytes per rank against the ideal")
