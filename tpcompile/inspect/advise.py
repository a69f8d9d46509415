"""``tpcompile advise``: which tensor-parallel degree to use for a model on a number of GPUs.

For each degree that divides the GPUs, the model is planned and rank 0's graph rewritten
exactly as ``parallelize`` would (on meta tensors: no memory, no GPU), and what that plan
holds per rank and sends per step is measured from it: parameter and buffer shards, gradients,
optimizer state, activations or KV cache, every collective the rewritten graph issues. The
:mod:`~tpcompile.inspect.costs` model turns those into an estimated step time; the degree
with the lowest estimate among those that fit in memory is the advice. Estimates, not
measurements: the model and its assumptions are printed with every answer.
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
from torch import fx, nn

from tpcompile.core.placement import Shard
from tpcompile.core.plan import PlanOptions
from tpcompile.inspect.costs import CostModel, matmul_flops, peak_flops, ring, ring_seconds
from tpcompile.inspect.explain import attr_dtypes
from tpcompile.inspect.explain_text import table
from tpcompile.inspect.plan_svg import human_bytes
from tpcompile.inspect.trace import RewriteTrace, trace_rewrite
from tpcompile.inspect.traffic import list_collectives
from tpcompile.passes.planner.rules import is_attention, is_view, viewed_from

__all__ = ["DegreeEstimate", "Advice", "advise", "SCHEMA"]

SCHEMA = "tpcompile.advise/1"


@dataclass(frozen=True)
class DegreeEstimate:
    """One tensor-parallel degree: bytes per rank (the largest rank), traffic and time per step.

    The fields up to ``flops`` are measured from the plan; the rest price them (:func:`price`).
    """

    tp: int
    dp: int                  # data-parallel replicas: GPUs / tp
    param_bytes: int         # trainable parameters
    buffer_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    kv_cache_bytes: int      # keys and values of every attention at the example's sizes
    memory_bytes: int        # what counts for the mode (training or inference)
    collectives: int         # tensor-parallel collectives per step
    collective_bytes: int    # their whole tensors' bytes (traffic.CollectiveEntry.bytes)
    tp_sent_bytes: float     # what each rank sends for them (ring algorithms)
    tp_ring_steps: int
    dp_sent_bytes: float     # what each rank sends for the data-parallel gradient all-reduce
    dp_ring_steps: int
    flops: float             # per rank per step
    fits: bool = False
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    step_s: float = 0.0


@dataclass(frozen=True)
class Advice:
    model: str
    gpus: int
    dtype: str
    inputs: list             # the example inputs' shapes at TP 1
    cost: CostModel
    degrees: list            # [DegreeEstimate], by degree
    best: int | None         # the fitting degree with the lowest step time; None if none fits

    def under(self, cost: CostModel) -> "Advice":
        """The same measurements priced for another device or efficiency (same mode)."""
        if cost.inference != self.cost.inference:
            raise ValueError("training and inference measure different things: advise again")
        return _decide(self.model, self.gpus, getattr(torch, self.dtype), self.inputs, cost,
                       self.degrees)

    def to_json(self) -> str:
        obj = asdict(self)
        obj["cost"]["assumptions"] = self.cost.assumptions()
        return json.dumps({"schema": SCHEMA, **obj}, sort_keys=True)

    def __str__(self) -> str:
        return _render(self)


def _repeat(x, times: int):
    """The example batch ``times`` over (dim 0), for the larger per-replica batch of a degree."""
    if isinstance(x, torch.Tensor) and x.dim() and times > 1:
        return x.repeat(times, *([1] * (x.dim() - 1)))
    return x


def _local_bytes(value, placement, trace: RewriteTrace) -> int:
    """Bytes rank 0 holds of ``value`` (a tensor or a tuple of them) under ``placement``."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    places = placement if isinstance(placement, (tuple, list)) else (placement,) * len(values)
    total = 0
    for v, p in zip(values, places):
        if not isinstance(v, torch.Tensor):
            continue
        shape = [int(s) for s in v.shape]
        if isinstance(p, Shard):  # a symbolic count of tiles: as many as the example holds
            tiles = shape[p.dim] // p.layout.tile_size if p.layout.tiles == 0 else 1
            shape[p.dim] = tiles * trace.plan.specs.local_size(p.layout, 0)
        total += math.prod(shape) * v.dtype.itemsize
    return total


def _share(node: fx.Node, user: fx.Node, trace: RewriteTrace) -> float:
    """The fraction of ``node`` that rank 0 holds where ``user`` reads it."""
    plan = trace.plan
    placement = plan.converted.get((node.name, user.name), plan.placements.get(node.name))
    value = node.meta.get("val")
    if value is None and node.op == "get_attr":  # export leaves some weights without a val
        value = operator.attrgetter(node.target)(trace.cap.gm)
    whole = _local_bytes(value, None, trace)
    return _local_bytes(value, placement, trace) / whole if whole else 1.0


def _weights(trace: RewriteTrace) -> tuple[int, int, int, int]:
    """(trainable parameter bytes, frozen parameter and buffer bytes, trainable elements,
    16-bit trainable elements) on the rank holding the most trainable bytes (uneven shards
    differ); tied tensors once. Frozen weights are held but get no gradient or optimizer state."""
    plan, dtypes, cap = trace.plan, attr_dtypes(trace), trace.cap
    per_rank = [[0, 0, 0, 0] for _ in range(plan.world_size)]
    seen = set()
    for name, p in plan.params.items():
        if p.aliases in seen:
            continue
        seen.add(p.aliases)
        trainable, size = name in cap.trainable, dtypes[name].itemsize
        for r, shape in enumerate(p.local_shapes):
            n = math.prod(shape)
            row = per_rank[r]
            row[0 if trainable else 1] += n * size
            if trainable:
                row[2] += n
                row[3] += n if size < 4 else 0
    return tuple(max(per_rank))


def _cached(read: float, operand: fx.Node, trace: RewriteTrace) -> float:
    """What a KV cache holds of an attention operand: the value before the views that repeat
    grouped KV heads for the query heads (``expand`` + ``reshape``), at the same share."""
    base = ([operand] + viewed_from(operand))[-1]
    whole, here = _local_bytes(base.meta.get("val"), None, trace), \
        _local_bytes(operand.meta.get("val"), None, trace)
    return read * whole / here if here else read


def _activations(trace: RewriteTrace) -> tuple[int, int, float]:
    """(activation bytes, KV-cache bytes, forward matmul FLOPs) of rank 0."""
    act = kv = 0
    flops = 0.0
    for node in trace.cap.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if not is_view(node):
            act += _local_bytes(node.meta.get("val"), trace.plan.placements.get(node.name), trace)
        whole, operands = matmul_flops(node)
        if whole:
            flops += whole * min(_share(a, node, trace) for a in operands)
        if is_attention(node):
            kv += sum(_cached(_share(a, node, trace) * _local_bytes(a.meta["val"], None, trace), a,
                              trace) for a in node.args[1:3])
    return act, int(kv), flops


def _measure(trace: RewriteTrace, gpus: int, train: bool) -> DegreeEstimate:
    tp = trace.plan.world_size
    dp = gpus // tp
    params, buffers, elements, half = _weights(trace)
    grads = params if train else 0
    optimizer = (8 * elements + 4 * half) if train else 0
    act, kv, forward_flops = _activations(trace)
    memory = params + buffers + (grads + optimizer + act if train else kv)
    collectives = [c for c in list_collectives(trace) if train or c.phase == "forward"]
    tp_rings = [ring(c.op, c.bytes or 0, tp) for c in collectives]
    dp_sent, dp_steps = ring("all_reduce", grads, dp)
    return DegreeEstimate(
        tp, dp, params, buffers, grads, optimizer, act if train else 0, kv, memory,
        len(collectives), sum(c.bytes or 0 for c in collectives),
        sum(sent for sent, _ in tp_rings), sum(steps for _, steps in tp_rings),
        dp_sent, dp_steps, forward_flops * (3 if train else 1))


def price(row: DegreeEstimate, cost: CostModel, dtype: torch.dtype) -> DegreeEstimate:
    """``row``'s time and fit on ``cost``'s device."""
    compute_s = row.flops / (peak_flops(cost.device, dtype) * cost.compute_efficiency)
    tp_comm_s = ring_seconds(row.tp_sent_bytes, row.tp_ring_steps, cost)
    dp_comm_s = ring_seconds(row.dp_sent_bytes, row.dp_ring_steps, cost)
    capacity = cost.device.memory_gib * 1024**3 * cost.usable_memory
    return replace(row, fits=row.memory_bytes <= capacity, compute_s=compute_s,
                   tp_comm_s=tp_comm_s, dp_comm_s=dp_comm_s,
                   step_s=compute_s + tp_comm_s + dp_comm_s)


def _decide(model: str, gpus: int, dtype: torch.dtype, inputs: list, cost: CostModel,
            measured: list) -> Advice:
    rows = [price(r, cost, dtype) for r in measured]
    fitting = [r for r in rows if r.fits]
    best = min(fitting, key=lambda r: (r.step_s, r.tp)).tp if fitting else None
    return Advice(model, gpus, str(dtype).removeprefix("torch."), inputs, cost, rows, best)


def advise(model: nn.Module, example_inputs, gpus: int, cost: CostModel, *,
           progress: Callable[[str], None] | None = None, **options) -> Advice:
    """Estimate every tensor-parallel degree dividing ``gpus`` for ``model``.

    Build ``model`` on the meta device: nothing is allocated. ``example_inputs`` are one
    replica's batch at TP 1; at degree d a replica runs d times that batch (dim 0), so the
    global batch is the same for every degree. ``options`` are ``parallelize``'s.
    """
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    measured = []
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        if progress is not None:
            progress(f"planning for tensor-parallel degree {tp}")
        inputs = tuple(_repeat(x, tp) for x in example_inputs)
        trace = trace_rewrite(model, inputs, tp, 0, copy_weights=False, dynamic=False,
                              options=PlanOptions(**options))
        measured.append(_measure(trace, gpus, not cost.inference))
    shapes = [list(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
    return _decide(type(model).__name__, gpus, dtype, shapes, cost, measured)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _render(a: Advice) -> str:
    mode = "inference" if a.cost.inference else "training"
    lines = [f"tpcompile advise: {a.model} ({a.dtype}) on {a.gpus} GPUs, {mode}, example inputs "
             f"{', '.join('x'.join(map(str, s)) for s in a.inputs)} per replica at TP 1", ""]
    lines += ["cost model (estimates, not measurements):"] + [f"  {x}" for x in a.cost.assumptions()]
    memory = ("params", "buffers", "grads", "optimizer", "activations") if not a.cost.inference \
        else ("params", "buffers", "kv cache")
    header = ("TP", "DP") + memory + ("total", "fits", "TP colls", "TP sent", "DP sent",
                                      "compute ms", "TP comm ms", "DP comm ms", "step ms")
    rows = []
    for r in a.degrees:
        sizes = (r.param_bytes, r.buffer_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_bytes) \
            if not a.cost.inference else (r.param_bytes, r.buffer_bytes, r.kv_cache_bytes)
        rows.append((r.tp, r.dp, *map(human_bytes, sizes), human_bytes(r.memory_bytes),
                     "yes" if r.fits else "no", r.collectives, human_bytes(int(r.tp_sent_bytes)),
                     human_bytes(int(r.dp_sent_bytes)), _ms(r.compute_s), _ms(r.tp_comm_s),
                     _ms(r.dp_comm_s), _ms(r.step_s) + (" *" if r.tp == a.best else "")))
    lines += ["", "per rank, per step:"] + table(header, rows)
    capacity = a.cost.device.memory_gib * a.cost.usable_memory
    if a.best is None:
        least = min(a.degrees, key=lambda r: r.memory_bytes)
        lines.append(f"\nno degree fits in {capacity:.1f} GiB per GPU: the smallest need is "
                     f"{human_bytes(least.memory_bytes)} at TP {least.tp}")
    else:
        r = next(r for r in a.degrees if r.tp == a.best)
        lines.append(f"\nadvice: TP {r.tp} x DP {r.dp}: the lowest estimated step time "
                     f"({_ms(r.step_s)} ms) of the degrees that fit in {capacity:.1f} GiB per GPU")
    return "\n".join(lines)
