"""The plan as a picture needs it: the repeated block found once, its weights in flow order.

A transformer's plan is the same for every layer, so the picture draws one layer (the block
most layers share, compared by each weight's style, shard dim and local shape, and by the
collectives per layer) and lists the layers that differ instead of drawing them again.
Weights become boxes in the order the graph first reads them; the column-parallel weights of
one chain (q, k, v; gate and up) share a row because they run side by side. Each collective
is placed on the edge after the last row computed before it, or on the box of the weight
whose gradient it all-reduces. Everything is read from an explain :class:`Report` and the
captured graph of its trace: this module decides nothing about the plan.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tpcompile.core.block_paths import block_path
from tpcompile.inspect.trace import RewriteTrace, source_line

__all__ = ["Box", "Row", "Section", "BlockView", "block_view", "short_shape"]


@dataclass(frozen=True)
class Box:
    """One weight (its bias folded in) as drawn."""

    label: str               # the name inside the block, '.weight' dropped: 'attention.wq'
    params: tuple[str, ...]  # the FQNs it stands for: the weight, then its bias
    style: str               # colwise | rowwise | replicate | vocab
    shapes: str              # '64x64 -> 8x64' (global -> local on the report's rank)
    chain: str
    reason: str
    grad_sync: bool          # its gradient (or a replicated block of it) is all-reduced
    source: str = ""         # the model line of the first op reading it


@dataclass
class Row:
    boxes: list[Box]
    position: int                                   # graph index of its first op
    marks_after: list = field(default_factory=list)  # CollectiveEntry on the edge below
    box_marks: dict = field(default_factory=dict)    # box label -> [CollectiveEntry]


@dataclass
class Section:
    title: str
    rows: list[Row]
    marks_before: list = field(default_factory=list)  # collectives on the edge entering it
    in_block: bool = False


@dataclass
class BlockView:
    block: str                     # 'layers.0', or '' when the model repeats nothing
    same: list[str]                # every layer drawn by the block (itself included)
    differing: dict[str, list[str]]  # layer -> what differs from the block
    sections: list[Section]        # before the block, the block, after it


def short_shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _first_use(trace: RewriteTrace) -> dict[str, int]:
    """Node name -> graph index; a weight's FQN -> the index of the first op reading it;
    a get_attr node's name -> '@' + its FQN (what a gradient sync's ``node`` names)."""
    nodes = list(trace.cap.gm.graph.nodes)
    index: dict = {n.name: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op == "get_attr" and n.users:
            index[n.target] = min(index[u.name] for u in n.users)
            index["@" + n.name] = n.target
    return index


def _sources(trace: RewriteTrace) -> dict[str, str]:
    """FQN -> the model line of the first op reading it."""
    return {n.target: source_line(next(iter(n.users)))
            for n in trace.cap.gm.graph.find_nodes(op="get_attr") if n.users}


def _boxes(report, names: list[str], prefix: str, sources: dict[str, str]) -> list[Box]:
    """One box per weight of ``names``; a bias joins its module's weight when there is one."""
    names = {n for n in names if report.params[n].parameter}
    boxes = []
    for name in sorted(names):
        p = report.params[name]
        if name.endswith(".bias") and name.removesuffix(".bias") + ".weight" in names:
            continue
        if name != p.aliases[0] and p.aliases[0] in report.params:
            continue  # a tied weight: one box, under its first name
        bias = name.removesuffix(".weight") + ".bias"
        params = (name, bias) if name.endswith(".weight") and bias in names else (name,)
        label = " = ".join(a.removeprefix(prefix).removesuffix(".weight") for a in p.aliases)
        boxes.append(Box(label, params, p.style,
                         f"{short_shape(p.global_shape)} -> {short_shape(p.local_shape)}",
                         p.chain, p.reason, any(report.params[n].grad_sync for n in params),
                         sources.get(name, "")))
    return boxes


def _rows(boxes: list[Box], order: dict[str, int]) -> list[Row]:
    """Boxes in flow order; a chain's entry weights (not its row-parallel exit) share a row."""
    rows: list[Row] = []
    for box in sorted(boxes, key=lambda b: (order.get(b.params[0], 0), b.label)):
        last = rows[-1].boxes[-1] if rows else None
        if (last is not None and box.chain and box.chain == last.chain
                and "rowwise" not in (box.style, last.style)):
            rows[-1].boxes.append(box)
        else:
            rows.append(Row([box], order.get(box.params[0], 0)))
    return rows


def _signature(report, layer: str, counts: dict) -> tuple:
    prefix = layer + "."
    params = tuple(sorted(
        (name.removeprefix(prefix), p.style, p.dim, tuple(p.local_shape), p.grad_sync)
        for name, p in report.params.items() if block_path(name) == layer))
    return params + (counts.get(layer, (0, 0)),)


def _differences(report, layer: str, block: str, counts: dict) -> list[str]:
    def table(l):
        return {name.removeprefix(l + "."): p for name, p in report.params.items()
                if block_path(name) == l}
    mine, base = table(layer), table(block)
    out = []
    for name in sorted(set(mine) | set(base)):
        a, b = mine.get(name), base.get(name)
        if a is None or b is None:
            out.append(f"{name}: {'only in ' + block if a is None else 'not in ' + block}")
        elif (a.style, a.dim, a.local_shape, a.grad_sync) != (b.style, b.dim, b.local_shape, b.grad_sync):
            out.append(f"{name}: {a.style} {short_shape(a.local_shape)} (block: {b.style} "
                       f"{short_shape(b.local_shape)})")
    if counts.get(layer, (0, 0)) != counts.get(block, (0, 0)):
        (f, b), (bf, bb) = counts.get(layer, (0, 0)), counts.get(block, (0, 0))
        out.append(f"collectives forward/backward {f}/{b} (block: {bf}/{bb})")
    return out


def _place(rows: list[Row], collectives, index: dict[str, int], marks_before: list) -> None:
    """Each collective onto its weight's box (gradient syncs) or the edge after its value."""
    for c in collectives:
        weight = index.get("@" + c.node)
        box = next((b for r in rows for b in r.boxes if weight in b.params), None)
        if box is not None:
            row = next(r for r in rows if box in r.boxes)
            row.box_marks.setdefault(box.label, []).append(c)
            continue
        at = index.get(c.node, -1)
        before = [r for r in rows if r.position <= at]
        (before[-1].marks_after if before else marks_before).append(c)


def block_view(report, trace: RewriteTrace) -> BlockView:
    """The picture's content: sections of rows of boxes, collectives placed, layers compared."""
    index = _first_use(trace)
    counts = {m.layer: (m.forward, m.backward) for m in report.megatron}
    layers: dict[str, list[str]] = {}
    for name in report.params:
        layers.setdefault(block_path(name), []).append(name)
    repeated = [layer for layer in layers if layer]
    sigs = {layer: _signature(report, layer, counts) for layer in repeated}
    block, same, differing = "", [], {}
    if repeated:
        common = Counter(sigs.values()).most_common(1)[0][0]
        same = sorted((layer for layer in repeated if sigs[layer] == common), key=_layer_key)
        block = same[0]
        differing = {layer: _differences(report, layer, block, counts)
                     for layer in sorted(repeated, key=_layer_key) if sigs[layer] != common}
    sources = _sources(trace)
    outside = _rows(_boxes(report, layers.get("", []), "", sources), index)
    if not block:
        section = Section("model", outside)
        _place(outside, [c for c in report.collectives if not c.layer], index, section.marks_before)
        return BlockView("", [], {}, [section])
    rows = _rows(_boxes(report, layers[block], block + ".", sources), index)
    start = rows[0].position
    head = Section("before the block", [r for r in outside if r.position < start])
    body = Section(block, rows, in_block=True)
    tail = Section("after the block", [r for r in outside if r.position >= start])
    _place(head.rows, [c for c in report.collectives if not c.layer and index.get(c.node, -1) < start],
           index, head.marks_before)
    _place(rows, [c for c in report.collectives if c.layer == block], index, body.marks_before)
    _place(tail.rows, [c for c in report.collectives if not c.layer and index.get(c.node, -1) >= start],
           index, tail.marks_before)
    return BlockView(block, same, differing, [s for s in (head, body, tail) if s.rows])


def _layer_key(layer: str):
    head, _, index = layer.rpartition(".")
    return (head, int(index) if index.isdigit() else 0)
