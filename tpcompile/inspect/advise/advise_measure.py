"""What ``advise`` measures from one planned and rewritten rank-0 graph (one TP degree, with
or without sequence parallelism): weights and their FSDP units, activations per
checkpointing mode, KV cache, matmul FLOPs and what full checkpointing recomputes.

Every number is read from the plan and the graph ``parallelize`` would run, never from a
formula of the model's shape; :mod:`tpcompile.inspect.advise.advise` turns them into one row per
configuration.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

from tpcompile.core.block_paths import block_of, repeated_block_paths
from tpcompile.core.placement import Shard
from tpcompile.inspect.advise.costs import matmul_flops
from tpcompile.inspect.explain.explain import attr_dtypes
from tpcompile.inspect.advise.retained import graph_retained_bytes
from tpcompile.inspect.trace import RewriteTrace
from tpcompile.inspect.traffic import list_collectives
from tpcompile.passes.planner.rules import is_attention, viewed_from
from tpcompile.passes.rewrite.checkpoint_regions import outlinable_regions

__all__ = ["Weights", "Measured", "measure_trace", "fsdp_shard_bytes", "mode_name"]


@dataclass(frozen=True)
class Weights:
    """The weights of the rank holding the most trainable bytes (uneven shards differ); tied
    tensors once. Frozen weights are held but get no gradient or optimizer state."""

    params: int              # trainable parameter bytes
    buffers: int             # frozen parameters and buffers
    elements: int            # trainable elements
    half: int                # 16-bit trainable elements (they get an fp32 master copy)
    shapes: tuple            # (local shape, itemsize) of each trainable tensor
    largest_unit: int        # the bytes of the largest FSDP unit: one block, or the rest (root)
    units: int               # FSDP units: the repeated blocks and the root


@dataclass(frozen=True)
class Measured:
    """One traced degree: weights, per-mode activations and FLOPs, collectives."""

    tp: int
    sp: bool
    weights: Weights
    activations: dict        # checkpointing mode ("none", "selective", "full") -> bytes
    recompute_flops: dict    # mode -> forward matmul FLOPs recomputed in backward
    kv_cache: int
    flops: float             # forward matmul FLOPs of rank 0
    collectives: list        # traffic.CollectiveEntry of rank 0's graph


def mode_name(mode: str | None) -> str:
    return mode or "none"


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


def _unit_of(name: str, blocks: list[str]) -> str:
    return next((b for b in blocks if name.startswith(b + ".")), "")


def _weights(trace: RewriteTrace) -> Weights:
    plan, dtypes, cap = trace.plan, attr_dtypes(trace), trace.cap
    blocks = repeated_block_paths(cap.gm)
    rows = [dict(params=0, buffers=0, elements=0, half=0, shapes=[], units={})
            for _ in range(plan.world_size)]
    seen = set()
    for name, p in plan.params.items():
        if p.aliases in seen:
            continue
        seen.add(p.aliases)
        trainable, size = name in cap.trainable, dtypes[name].itemsize
        for r, shape in enumerate(p.local_shapes):
            n, row = math.prod(shape), rows[r]
            if not trainable:
                row["buffers"] += n * size
                continue
            row["params"] += n * size
            row["elements"] += n
            row["half"] += n if size < 4 else 0
            row["shapes"].append((tuple(shape), size))
            unit = _unit_of(name, blocks)
            row["units"][unit] = row["units"].get(unit, 0) + n * size
    row = max(rows, key=lambda r: r["params"])
    return Weights(row["params"], row["buffers"], row["elements"], row["half"],
                   tuple(row["shapes"]), max(row["units"].values(), default=0),
                   len(row["units"]))


def fsdp_shard_bytes(weights: Weights, dp: int) -> tuple[int, int, int]:
    """(trainable bytes, elements, 16-bit elements) of one FSDP2 shard over ``dp`` ranks:
    each tensor cut on dim 0 into ``ceil(dim0 / dp)`` rows (FSDP2 pads the last shard)."""
    nbytes = elements = half = 0
    for shape, size in weights.shapes:
        n = math.prod(shape[1:]) * -(-shape[0] // dp) if shape else 1
        nbytes, elements, half = nbytes + n * size, elements + n, half + (n if size < 4 else 0)
    return nbytes, elements, half


def _cached(read: float, operand: fx.Node, trace: RewriteTrace) -> float:
    """What a KV cache holds of an attention operand: the value before the views that repeat
    grouped KV heads for the query heads (``expand`` + ``reshape``), at the same share."""
    base = ([operand] + viewed_from(operand))[-1]
    whole, here = _local_bytes(base.meta.get("val"), None, trace), \
        _local_bytes(operand.meta.get("val"), None, trace)
    return read * whole / here if here else read


def _flops_and_kv(trace: RewriteTrace) -> tuple[dict, int]:
    """({node name: forward matmul FLOPs rank 0 computes}, KV-cache bytes of rank 0)."""
    flops, kv = {}, 0.0
    for node in trace.cap.gm.graph.nodes:
        if node.op != "call_function":
            continue
        whole, operands = matmul_flops(node)
        if whole:
            flops[node.name] = whole * min(_share(a, node, trace) for a in operands)
        if is_attention(node):
            kv += sum(_cached(_share(a, node, trace) * _local_bytes(a.meta["val"], None, trace), a,
                              trace) for a in node.args[1:3])
    return flops, int(kv)


def _recomputed(trace: RewriteTrace, flops: dict, mode: str | None) -> float:
    """Forward matmul FLOPs backward runs again: every matmul of a block ``"full"``
    checkpoints (``"selective"`` saves the matmuls' outputs: none)."""
    if mode != "full":
        return 0.0
    kept = {region.name for region in outlinable_regions(trace.gm, mode)[0]}
    paths = repeated_block_paths(trace.cap.gm)
    return sum(flops.get(n.name, 0.0) for n in trace.cap.gm.graph.nodes
               if n.name in flops and block_of(n, paths) in kept)


def measure_trace(trace: RewriteTrace, inputs: tuple, modes, train: bool) -> Measured:
    """Everything ``advise`` reads of one degree's ``trace`` (planned at ``inputs``), with the
    activations of each checkpointing mode of ``modes`` (``parallelize``'s values)."""
    flops, kv = _flops_and_kv(trace)
    activations = {mode_name(m): graph_retained_bytes(trace.gm, inputs, m) if train else 0
                   for m in modes}
    recompute = {mode_name(m): _recomputed(trace, flops, m) for m in modes}
    return Measured(trace.plan.world_size, trace.plan.options.sequence_parallel, _weights(trace),
                    activations, recompute, kv, sum(flops.values()), list_collectives(trace))
