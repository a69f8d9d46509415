"""What Megatron's backward all-reduces carry: the bytes of the bound (:mod:`.bound`).

A partial gradient is summed once, but where it is summed decides the bytes. The bound's
count says how many all-reduces; this module says how large each is, at the cheapest place a
hand plan could sum it:

* A group of colwise inputs that share reduce points (:func:`~.bound_graph.reduce_points`:
  q, k and v at their norm; a parallel block's two norms at its input) is summed either at
  each input (one bucket of several tensors) or at one shared point; carrying the partial
  gradient back to a point makes the gradients of the whole tensors it passes (a norm's gain,
  a whole down projection) partial too, so they ride along. The cheaper of the two
  (``sync_bytes``): the tokens before a MoE's dense expansion, not the expanded copy; a
  float32 input, not its float64 cast; MLA's narrow latents, not the block's input.
* Values that enter the cut features from outside them (``entering``) have partial gradients
  of their own: a router's probabilities or an adaLN-Zero gate scaling a row-parallel partial
  sum, a per-layer input multiplied into a column-parallel output, Mamba's B and C read by a
  scan over cut channels, MLA's shared rotary key concatenated to cut heads. Their bytes ride
  in the block's input sync (not an all-reduce of their own: they are ready with it).
* Trainable tensors read there (``whole_read``) are whole when no dim of theirs is a cut size;
  a packed weight's bias (its rows), a per-head ``A_log``, a depthwise conv over Mamba-2's
  x, B and C (a run of its in_proj's pieces) are cut, the conv's whole B / C rows
  (``whole_part_bytes``) summed with in_proj's.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.inspect.bound.bound_graph import (
    Matmul, differentiable, is_product, layer_of, reduce_points, sizes, value_bytes, value_users,
)
from tpcompile.passes.planner.rules.quantized import stored_inputs
from tpcompile.passes.planner.rules.table import is_view
from tpcompile.passes.planner.rules.writes import any_placement

__all__ = ["before_summands", "cut_region", "entering", "reduced_bytes", "scales", "sync_bytes",
           "values_bytes", "whole_part_bytes", "whole_read"]

aten = torch.ops.aten
_ADDS = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
_SCALES = {aten.mul.Tensor, aten.div.Tensor}  # ops that scale a partial sum by another value


def cut_region(layer: str, cols: list[Matmul], by_node: dict) -> set[fx.Node]:
    """The values computed from ``cols``' cut outputs within ``layer``, up to the next
    matmul (attention, norms over the cut features and their statistics included)."""
    reached, todo = set(), [u for c in cols for u in c.node.users]
    while todo:
        n = todo.pop()
        if n in reached or n in by_node or n.op != "call_function" or layer_of(n) != layer:
            continue
        reached.add(n)
        todo.extend(n.users)
    return reached


def _cut_sizes(cols: list[Matmul], world_size: int, stored: dict) -> tuple[set, dict]:
    """(sizes a tensor cut with ``cols`` has: output features, pieces and runs of pieces,
    a packed weight's rows; heads -> their features) and, per run of pieces holding pieces of
    fewer heads than ranks, the fraction of its features kept whole."""
    features, whole = {m.out_features for m in cols}, {}
    for m in cols:
        w = stored.get(m.weights[0])
        features |= {d for d in sizes(w) if d and d != m.in_features} if w is not None else set()
        parts = [(f, h is not None and h < world_size) for f, h in m.parts]
        for i in range(len(parts)):
            for j in range(i + 1, len(parts) + 1):
                run = sum(f for f, _ in parts[i:j])
                kept = sum(f for f, is_whole in parts[i:j] if is_whole)
                if kept < run:
                    features.add(run)
                if 0 < kept < run:
                    whole[run] = kept / run
    return features, whole


def _is_cut(dims: list, features: set, heads: dict) -> bool:
    """A tensor with a dim of a cut size; a 1-D one of heads == head dim is taken for the
    latter (its features are the head dim, shared by every head)."""
    return bool(features & set(dims)) or any(
        h in dims and (len(dims) > 1 or h * h != f) for h, f in heads.items())


def whole_read(layer: str, cols: list[Matmul], mms: list[Matmul], trainable: frozenset,
               world_size: int) -> list[fx.Node]:
    """Trainable tensors other than matmul weights that are read in ``cols``' cut region and
    have no dim of a cut size (``_cut_sizes``) of the matmuls whose cut features reach the op
    reading them, so Megatron keeps them whole: a per-head q / k norm's weight (its head dim
    is no cut size of the attention, whatever the MLP's width). Their gradients are partial
    sums."""
    by_node, stored, out = {m.node: m for m in mms}, _stored(mms), {}
    readers: dict[fx.Node, list[Matmul]] = {}
    for c in cols:
        for n in cut_region(layer, [c], by_node):
            readers.setdefault(n, []).append(c)
    for n, reach in readers.items():
        features, _ = _cut_sizes(reach, world_size, stored)
        heads = {m.heads: m.out_features for m in reach if m.heads}
        heads |= {h: f for m in reach for f, h in m.parts if h and h >= world_size}
        for a in n.all_input_nodes:
            found = stored_inputs(a)
            for leaf in found[0] if found else ():
                if leaf.target in trainable and not _is_cut(sizes(leaf), features, heads):
                    out[leaf.target] = leaf
    return list(out.values())


def whole_part_bytes(layer: str, cols: list[Matmul], mms: list[Matmul], trainable: frozenset,
                     world_size: int) -> int:
    """The gradient bytes of the whole rows of trainable non-matmul tensors cut with a run of
    a fused output's pieces that holds pieces of fewer heads than ranks (Mamba-2's depthwise
    conv over x, B and C: its B and C channels), summed with the fused weight's whole rows."""
    _, whole = _cut_sizes(cols, world_size, _stored(mms))
    out = {}
    for n in cut_region(layer, cols, {m.node: m for m in mms}) | {m.node for m in cols}:
        for a in n.all_input_nodes:
            found = stored_inputs(a)
            for leaf in found[0] if found else ():
                part = max((whole.get(d, 0.0) for d in sizes(leaf) if d), default=0.0)
                if leaf.target in trainable and part and leaf.target not in \
                        {w for m in mms for w in m.weights}:
                    out[leaf.target] = int(value_bytes(leaf) * part)
    return sum(out.values())


def _stored(mms: list[Matmul]) -> dict:
    """Weight target -> its get_attr node (the leaves the matmuls read)."""
    return {leaf.target: leaf for m in mms for a in m.node.all_input_nodes
            for leaf in (stored_inputs(a) or ([], []))[0]}


def entering(layer: str, cols: list[Matmul], mms: list[Matmul], carriers: set,
             skip: set) -> list[fx.Node]:
    """Values with a gradient (``carriers``) that enter the cut region from outside it: not a
    stored tensor, a colwise input (synced anyway), a value of ``skip`` (a whole KV head,
    priced by the bound itself), a value computed in the block from stored tensors alone (a
    bias gathered per expert, a sink expanded per head: ``whole_read`` judges those), nor
    one shaped per head, ``(batch, heads, ...)``, which Megatron cuts with the heads (T5's
    relative position bias; not one value copied to every head)."""
    by_node = {m.node: m for m in mms}
    region = cut_region(layer, cols, by_node)
    inside = region | skip | {m.activation for m in cols} | {m.node for m in cols}
    heads = {m.heads for m in cols if m.heads}
    return [a for a in _from_outside(region, inside, carriers)
            if not _stored_only(a, layer, by_node)
            and not (len(dims := sizes(a)) == 4 and dims[1] in heads and not _broadcast(a))]


def _broadcast(node: fx.Node) -> bool:
    """``node`` is a view that copies its source (an ``expand`` of MLA's rotary key to every
    head): its heads are copies of one value, not a value per head."""
    while is_view(node) and node.all_input_nodes:
        src = node.all_input_nodes[0]
        if (_known(node) or 0) > (_known(src) or 0):
            return True
        node = src
    return False


def _stored_only(node: fx.Node, layer: str, by_node: dict) -> bool:
    """``node`` is computed within ``layer`` from stored tensors (and indices) alone: no
    matmul's output and no value from outside the block."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or stored_inputs(n) is not None or not differentiable(n.meta.get("val")):
            continue
        if n in by_node or n.op != "call_function" or layer_of(n) != layer:
            return False
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return True


def scales(reach: set, carriers: set) -> list[fx.Node]:
    """Values with a gradient that scale a partial sum within ``reach`` (a router's
    probabilities, an adaLN-Zero gate): their gradients are partial where the sum is."""
    return _from_outside([n for n in reach if n.target in _SCALES or is_product(n)], reach,
                         carriers)


def _from_outside(readers, inside: set, carriers: set) -> list[fx.Node]:
    """The floating-point, non-stored inputs of ``readers`` outside ``inside`` that carry a
    gradient, each once."""
    return list(dict.fromkeys(
        a for n in readers for a in n.all_input_nodes
        if a not in inside and a in carriers and stored_inputs(a) is None
        and differentiable(a.meta.get("val"))))


def sync_bytes(acts: list[fx.Node], points: list[fx.Node], layer: str,
               trainable: frozenset, stop: set) -> int:
    """The bytes of one sync of the partial gradients of ``acts`` (a group's colwise inputs,
    or one entering value): summed apart (one bucket), or at one shared point of ``points``
    with the whole tensors in between (whose gradients it makes partial), whichever is fewer.
    A value whose size depends on the data (a MoE's gathered tokens) is summed at a point of
    known size."""
    acts = list(dict.fromkeys(acts))
    apart = [_known(a) for a in acts]
    prices = [sum(apart)] if None not in apart else []
    prices += [_known(p) + _crossed(acts, p, layer, trainable, stop)
               for p in points if _known(p) is not None]
    return min(prices, default=0)


def values_bytes(values: list[fx.Node], layer: str, trainable: frozenset, stop: set) -> int:
    """The bytes of one sync of the partial gradients of ``values`` (entering or scaling
    values): each at its cheapest point, or all at a point they share (a router's
    probabilities, picked per expert), whichever is fewer."""
    if not values:
        return 0
    points = {v: reduce_points(v, layer, stop) for v in values}
    shared = [p for p in points[values[0]] if all(p in ps for ps in points.values())]
    apart = sum(sync_bytes([v], points[v], layer, trainable, stop) for v in values)
    return min(apart, sync_bytes(values, shared, layer, trainable, stop))


def _known(node: fx.Node) -> int | None:
    """``node``'s bytes; None when a size has no example value."""
    return value_bytes(node) if None not in sizes(node) else None


def _crossed(acts: list[fx.Node], point: fx.Node, layer: str, trainable: frozenset,
             stop: set) -> int:
    """The bytes of the trainable tensors read between ``point`` and ``acts`` (a norm's gain,
    a whole down projection's weight)."""
    seen, leaves, todo = set(), {}, [a for a in acts if a is not point]
    while todo:
        n = todo.pop()
        if n in seen or n is point or n in stop or n.op != "call_function" \
                or layer_of(n) != layer:
            continue
        seen.add(n)
        for a in () if any_placement(n) else n.all_input_nodes:  # a fresh buffer: no data
            found = stored_inputs(a)
            if found is not None:
                leaves.update({leaf.target: leaf for leaf in found[0] if leaf.target in trainable})
            elif differentiable(a.meta.get("val")):
                todo.append(a)
    return sum(value_bytes(leaf) for leaf in leaves.values())


def reduced_bytes(reach: set) -> int:
    """The bytes of one all-reduce of a group's partial sums where the sum leaves ``reach``
    (read by an op that does not keep it a sum, or by the next block): the values it leaves
    at, but a value made in ``reach`` from another of them (a cast of the sum) only through
    that one. A sum split into pieces that each leave (a single-stream block's text and image
    tokens) is reduced whole, every piece; a piece nothing reads is not reduced."""
    ends = {n for n in reach if any(u not in reach for u in value_users(n))}
    first = [n for n in ends if not _made_in(n, ends - {n}, reach)]
    return sum(value_bytes(n) for n in first) if first else max(value_bytes(n) for n in reach)


def before_summands(reach: set) -> set:
    """The part of one partial sum's ``reach`` before a sum adds a value from outside it (the
    residual stream): past it the sum goes on only as a carried sum, the value one rank's
    summand. Megatron reduces a row-parallel output before its residual add; tpcompile carries
    a sum that way only to meet another partial sum (``carried_sums``)."""
    cut = [n for n in reach if n.target in _ADDS and any(
        a not in reach and differentiable(a.meta.get("val")) for a in n.all_input_nodes)]
    past, todo = set(), cut
    while todo:
        n = todo.pop()
        if n not in past:
            past.add(n)
            todo += [u for u in n.users if u in reach]
    return reach - past


def _made_in(node: fx.Node, sources: set, reach: set) -> bool:
    """Whether ``node`` is computed, inside ``reach``, from one of ``sources``."""
    seen, todo = set(), [a for a in node.all_input_nodes if a in reach]
    while todo:
        n = todo.pop()
        if n in sources:
            return True
        if n not in seen:
            seen.add(n)
            todo += [a for a in n.all_input_nodes if a in reach]
    return False
