"""``tpcompile.explain``: what tpcompile would do to a model, before a GPU hour is spent on it.

The report is plain data computed without a process group (and, for a model built on the meta
device, without memory): per parameter the style, dim and global -> local shape and the chain
that explains it; every collective with its phase, shape and bytes; per-rank parameter bytes;
the ops that forced a fallback; the comparison with Megatron's lower bound; and the equivalent
``parallelize_module`` plan where one exists. ``str(report)`` is for people, ``to_json()`` for
programs (schema in docs/explain.md).
"""

from __future__ import annotations

import json
import operator
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn

from tpcompile.inspect.explain.dtensor_plan import dtensor_styles, to_parallel_styles
from tpcompile.passes.planner.rules.quantized import quantized_weights, weight_targets
from tpcompile.passes.planner.unapplied_options import announce, unapplied_checkpointing
from tpcompile.passes.rewrite.checkpoint_regions import outlinable_regions
from tpcompile.core.placement import Shard
from tpcompile.core.plan import PlanOptions
from tpcompile.inspect.explain.expert_load import expert_loads
from tpcompile.inspect.explain.explain_html import page
from tpcompile.inspect.explain.explain_text import render
from tpcompile.inspect.explain.plan_block import block_view
from tpcompile.inspect.explain.recompute import recomputed_calls
from tpcompile.inspect.trace import RewriteTrace, module_path, source_line, trace_rewrite
from tpcompile.inspect.traffic import (
    CollectiveEntry, LayerTraffic, dtype_name, list_collectives, megatron_comparison, nbytes,
)

__all__ = ["ParamEntry", "Report", "explain", "SCHEMA"]

SCHEMA = "tpcompile.explain/1"


@dataclass(frozen=True)
class ParamEntry:
    """One parameter or buffer (tied weights: one entry per name, the same tensor)."""

    style: str               # colwise | rowwise | expert | replicate (| vocab once the planner has it)
    dim: int | None          # the sharded dim; None when every rank holds all of it
    global_shape: list
    local_shape: list        # on the report's rank
    local_shapes: list       # on every rank (uneven shards differ)
    dtype: str
    parameter: bool          # a parameter, trainable or frozen (False for buffers)
    trainable: bool          # a parameter that requires grad
    grad_sync: bool          # its gradient is all-reduced (replicated inside a sharded chain)
    chain: str               # the column -> row chain it belongs to; '' if none
    reason: str              # the planner's reason for the style
    aliases: list            # every FQN naming this tensor
    # a buffer weight-only quantization stores for a matmul's weight (an integer weight, the
    # scales and zeros its dequantization reads): counted in the parameter bytes
    quantized: bool = False


@dataclass(frozen=True)
class Report:
    model: str
    world_size: int
    rank: int
    inputs: list             # [{"shape", "dtype"}] of the example inputs
    params: dict             # FQN -> ParamEntry
    chains: dict             # name -> {"layer", "colwise", "rowwise", "replicated_blocks", "summary"}
    collectives: list        # [CollectiveEntry], graph order, forward and backward
    param_bytes_per_rank: list
    param_bytes_total: int   # the unsharded model's parameters, trainable or frozen
    fallbacks: list          # [{"node", "module", "reason"}]: gathered before an op without a rule
    kept_replicated: list    # [{"node", "module", "reason"}]: matmuls the planner did not shard
    megatron: list           # [LayerTraffic]
    dtensor_plan: dict       # module -> "colwise" | "rowwise"
    not_expressible: dict    # module -> why parallelize_module cannot do what tpcompile does
    # activation checkpointing: {"kept": [region], "dropped": [{"region", "reason"}]}
    checkpointing: dict = field(default_factory=lambda: {"kept": [], "dropped": []})
    experts: dict = field(default_factory=dict)  # MoE module -> how its experts are cut, why
    # grouped-matmul MoE module -> rows of the example routed to each rank's whole experts, or
    # why they were not measured (the example does not run on this device)
    expert_load: dict = field(default_factory=dict)
    # per rank under Megatron's plan (tpcompile.inspect.bound.bound): split weights / N + the rest
    param_bytes_ideal: float = 0.0
    # the plan's notes: what capture changed about the call, and each option that did nothing
    notes: list = field(default_factory=list)

    def collective_counts(self) -> dict[str, dict[str, int]]:
        """Per phase, per op: the same shape of data as ``count_collectives``."""
        counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        for c in self.collectives:
            counts[c.phase][c.op] = counts[c.phase].get(c.op, 0) + 1
        return counts

    def to_dtensor_plan(self, strict: bool = False) -> dict:
        """The ``parallelize_module`` plan for the modules that have one.

        Modules whose tpcompile layout PyTorch's styles cannot express are left out (they stay
        replicated under that plan) and listed in ``not_expressible``; ``strict=True`` raises a
        :class:`~tpcompile.TPCompileError` instead.
        """
        return to_parallel_styles(self.dtensor_plan, self.not_expressible, strict)

    def to_json(self) -> str:
        obj = asdict(self)
        obj["dtensor"] = {"plan": obj.pop("dtensor_plan"),
                          "not_expressible": obj.pop("not_expressible")}
        return json.dumps({"schema": SCHEMA, **obj}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Report":
        obj = json.loads(text)
        if obj.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} report (schema {obj.get('schema')!r})")
        del obj["schema"]
        dtensor = obj.pop("dtensor")
        return Report(
            **{**obj, "params": {k: ParamEntry(**v) for k, v in obj["params"].items()},
               "collectives": [CollectiveEntry(**c) for c in obj["collectives"]],
               "megatron": [LayerTraffic(**m) for m in obj["megatron"]]},
            dtensor_plan=dtensor["plan"], not_expressible=dtensor["not_expressible"])

    def __str__(self) -> str:
        return render(self)


def attr_dtypes(trace: RewriteTrace) -> dict:
    """Every tensor attribute's dtype; export leaves some get_attr nodes (tied aliases,
    constants) without ``meta['val']``, so the tensor itself answers."""
    gm = trace.cap.gm
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = n.meta.get("val")
            if not isinstance(value, torch.Tensor):
                value = operator.attrgetter(n.target)(gm)
            if isinstance(value, torch.Tensor):
                out[n.target] = value.dtype
    return out


def _params(trace: RewriteTrace) -> dict[str, ParamEntry]:
    plan, rank, dtypes = trace.plan, trace.rank, attr_dtypes(trace)
    quantized = quantized_weights(trace.cap.gm) | trace.cap.subclass_parts
    out = {}
    for name, p in sorted(plan.params.items()):
        sharded = isinstance(p.placement, Shard) and p.style != "replicate"
        out[name] = ParamEntry(
            style=p.style, dim=p.placement.dim if sharded else None,
            global_shape=list(p.global_shape), local_shape=list(p.local_shapes[rank]),
            local_shapes=[list(s) for s in p.local_shapes], dtype=dtype_name(dtypes[name]),
            parameter=name in trace.cap.params, trainable=name in trace.cap.trainable,
            grad_sync=p.grad_sync,
            chain=trace.chain_of.get(_node_name(trace, name), ""), reason=p.reason,
            aliases=list(p.aliases), quantized=name in quantized)
    return out


def _node_name(trace: RewriteTrace, target: str) -> str:
    for node in trace.gm.graph.find_nodes(op="get_attr", target=target):
        return node.name
    return ""


def param_bytes(trace: RewriteTrace) -> tuple[list[int], int]:
    """Per-rank and unsharded bytes of the parameters (trainable or frozen) and of the
    buffers quantization stores instead (integer or float8 weights, the scales and zeros
    their dequantization reads, every part of a tensor-subclass weight), each tensor once."""
    seen, per_rank, total = set(), [0] * trace.plan.world_size, 0
    dtypes = attr_dtypes(trace)
    weights = weight_targets(trace.cap)
    for name, p in trace.plan.params.items():
        if name not in weights or p.aliases in seen:
            continue
        seen.add(p.aliases)
        total += nbytes(list(p.global_shape), dtypes[name])
        for r, shape in enumerate(p.local_shapes):
            per_rank[r] += nbytes(list(shape), dtypes[name])
    return per_rank, total


def _located(trace: RewriteTrace, reasons: dict[str, str]) -> list[dict]:
    """Fallbacks (keyed by node) and kept-replicated weights (keyed by FQN), each with the
    module and the model line of the op concerned (for a weight: the op that reads it)."""
    gm = trace.cap.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    for target in reasons:
        for attr in gm.graph.find_nodes(op="get_attr", target=target):
            nodes[target] = next(iter(attr.users), attr)
    out = []
    for name, why in sorted(reasons.items()):
        node = nodes.get(name)
        out.append({"node": name, "module": module_path(node) if node is not None else "",
                    "reason": why, "source": source_line(node) if node is not None else ""})
    return out


def _checkpointing(trace: RewriteTrace, mode: str | None) -> dict:
    """The checkpointed regions ``parallelize`` keeps, and those it warns about."""
    kept, dropped = outlinable_regions(trace.gm, mode)
    return {"kept": [r.name for r in kept],
            "dropped": [{"region": name, "reason": why} for name, why in dropped]}


def _notes(trace: RewriteTrace, mode: str | None, regions: dict) -> list[str]:
    """The plan's notes and, as ``parallelize`` warns, a checkpointing mode that found nothing."""
    unapplied = unapplied_checkpointing(mode, regions["kept"], regions["dropped"])
    return list(announce(trace.plan, unapplied, stacklevel=3).notes)


def explain(model: nn.Module, example_inputs, world_size: int, *, rank: int = 0,
            progress: Callable[[str], None] | None = None, dynamic: bool = True,
            example_kwargs: dict | None = None, html: bool = False, reuse_blocks: bool = True,
            activation_checkpointing: str | None = None, **options):
    """Plan ``model`` for ``world_size`` ranks and report what the rewrite would do.

    Needs no process group and no GPU; build the model under ``torch.device("meta")`` to plan
    a large model without allocating its weights. ``rank`` picks whose local shapes are shown
    (they differ only for uneven shards); ``progress`` receives a line per step.
    ``example_kwargs`` and ``options`` (``vocab_parallel``, ``loss_parallel``,
    ``sequence_parallel``) are ``parallelize``'s: the report is of the plan that call makes.
    ``dynamic=False`` captures at the example's sizes only: the same plan, 2.5x faster to
    capture a large model (the rewritten code then shows those sizes as constants).
    ``html=True`` returns the self-contained HTML page instead (a picture of the plan: see
    :mod:`tpcompile.inspect.explain.explain_html`).
    ``reuse_blocks`` (default) exports three of a model's identical blocks and repeats one for
    the rest: the same report, in a time that hardly grows with depth (docs/scaling.md).
    ``activation_checkpointing`` is ``parallelize``'s: the report lists the regions recomputed
    in backward and those that stay inline, with the reason.
    """
    trace = trace_rewrite(model, example_inputs, world_size, rank, copy_weights=False,
                          progress=progress, dynamic=dynamic, example_kwargs=example_kwargs,
                          options=PlanOptions(**options), reuse_blocks=reuse_blocks)
    report = report_of(trace, model, example_inputs, example_kwargs, activation_checkpointing)
    return page(report, block_view(report, trace)) if html else report


def report_of(trace: RewriteTrace, model: nn.Module, example_inputs, example_kwargs=None,
              activation_checkpointing: str | None = None) -> Report:
    """:func:`explain`'s report of a trace (``bench.idioms`` reuses the trace for every rank)."""
    collectives = list_collectives(trace, recomputed_calls(trace.gm, activation_checkpointing))
    per_rank, total = param_bytes(trace)
    styles, missing = dtensor_styles(trace, model)
    regions = _checkpointing(trace, activation_checkpointing)
    return Report(
        model=trace.model_name, world_size=trace.plan.world_size, rank=trace.rank,
        inputs=[{"shape": list(s), "dtype": dtype_name(d)} for s, d in trace.cap.input_specs],
        params=_params(trace),
        chains={c.name: {"layer": c.layer, "colwise": list(c.colwise), "rowwise": list(c.rowwise),
                         "replicated_blocks": list(c.replicated_blocks), "summary": c.describe()}
                for c in trace.chains},
        collectives=collectives, param_bytes_per_rank=per_rank, param_bytes_total=total,
        fallbacks=_located(trace, trace.plan.fallbacks),
        kept_replicated=_located(trace, trace.plan.replicated),
        megatron=megatron_comparison(trace, collectives),
        dtensor_plan=styles, not_expressible=missing,
        checkpointing=regions, notes=_notes(trace, activation_checkpointing, regions),
        experts=dict(trace.plan.experts), param_bytes_ideal=trace.bound.ideal_bytes,
        expert_load=expert_loads(model, example_inputs, example_kwargs, trace.cap.gm,
                                 trace.plan.world_size) if trace.plan.experts else {})
