"""``tpcompile advise``: how to split a model's training (or inference) over a number of GPUs.

For each tensor-parallel degree TP dividing the GPUs, with and without sequence parallelism,
the model is planned and rank 0's graph rewritten exactly as ``parallelize`` would (on meta
tensors: no memory, no GPU), and what that plan holds per rank and sends per step is measured
from it (:mod:`~tpcompile.inspect.advise.advise_measure`): parameter and buffer shards, every
collective, matmul FLOPs, and the activations the forward leaves for backward under each
activation-checkpointing mode (the graph run on meta tensors with its regions outlined). The
other GPUs / TP ranks are data-parallel, either replicated (gradients all-reduced) or FSDP2
(parameters, gradients and optimizer state sharded, all-gathered per block). Each
(TP, data parallelism, checkpointing, SP) configuration is priced by the
:mod:`~tpcompile.inspect.advise.costs` model; the advice is the fastest that fits in memory. For an
MoE model, each block's expert cut (expert-TP or whole experts per rank) is priced at each
degree by ``experts="auto"``'s cost model (:mod:`~tpcompile.inspect.advise.advise_experts`).
Estimates, not measurements: the model and its assumptions are printed with every answer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from tpcompile.core.plan import PlanOptions
from tpcompile.inspect.advise.advise_experts import expert_choices
from tpcompile.inspect.advise.advise_measure import Measured, fsdp_shard_bytes, measure_trace, mode_name
from tpcompile.inspect.advise.costs import CostModel, peak_flops, ring, ring_seconds
from tpcompile.inspect.trace import trace_rewrite
from tpcompile.passes.rewrite.checkpoint_regions import MODES

__all__ = ["Estimate", "Advice", "advise", "SCHEMA"]

SCHEMA = "tpcompile.advise/3"


@dataclass(frozen=True)
class Estimate:
    """One configuration: bytes per rank (the largest rank), traffic and time per step.

    The fields up to ``flops`` are measured from the plan; the rest price them (:func:`price`).
    """

    tp: int
    dp: int                  # data-parallel ranks: GPUs / tp
    fsdp: bool               # FSDP2 over the dp ranks (else replicas with an all-reduce)
    checkpointing: str       # "none", "selective" or "full" (parallelize's option)
    sp: bool                 # sequence parallelism (parallelize's option)
    param_bytes: int         # trainable parameters (this rank's FSDP shard under FSDP)
    buffer_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int    # what the forward leaves alive for backward
    fsdp_unit_bytes: int     # FSDP: the largest unit all-gathered, and its unsharded gradients
    kv_cache_bytes: int      # keys and values of every attention at the example's sizes
    memory_bytes: int        # what counts for the mode (training or inference)
    collectives: int         # tensor-parallel collectives per step
    collective_bytes: int    # their whole tensors' bytes (traffic.CollectiveEntry.bytes)
    tp_sent_bytes: float     # what each rank sends for them (ring algorithms)
    tp_ring_steps: int
    dp_sent_bytes: float     # what each rank sends for data parallelism
    dp_ring_steps: int
    flops: float             # per rank per step, recomputation included
    fits: bool = False
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    step_s: float = 0.0

    def label(self) -> str:
        dp = f"FSDP {self.dp}" if self.fsdp else f"DP {self.dp}"
        return f"TP {self.tp} x {dp}, checkpointing {self.checkpointing}" + \
            (", sequence parallel" if self.sp else "")


@dataclass(frozen=True)
class Advice:
    model: str
    gpus: int
    dtype: str
    inputs: list             # the example inputs' shapes at TP 1
    cost: CostModel
    configs: list            # [Estimate]
    best: int | None         # index in configs of the fastest that fits; None if none fits
    experts: list = field(default_factory=list)  # [ExpertChoice] per TP degree > 1 and block

    def under(self, cost: CostModel) -> "Advice":
        """The same measurements priced for another device or efficiency (same mode)."""
        if cost.inference != self.cost.inference:
            raise ValueError("training and inference measure different things: advise again")
        return _decide(self.model, self.gpus, getattr(torch, self.dtype), self.inputs, cost,
                       self.configs, self.experts)

    @property
    def best_config(self) -> Estimate | None:
        return None if self.best is None else self.configs[self.best]

    def to_json(self) -> str:
        obj = asdict(self)
        obj["cost"]["assumptions"] = self.cost.assumptions()
        return json.dumps({"schema": SCHEMA, **obj}, sort_keys=True)

    def __str__(self) -> str:
        from tpcompile.inspect.advise.advise_text import render
        return render(self)


def _repeat(x, times: int):
    """The example batch ``times`` over (dim 0), for the larger per-replica batch of a degree."""
    if isinstance(x, torch.Tensor) and x.dim() and times > 1:
        return x.repeat(times, *([1] * (x.dim() - 1)))
    return x


def _dp_traffic(m: Measured, dp: int, fsdp: bool, train: bool) -> tuple:
    """(param, grad, optimizer, FSDP unit bytes per rank, bytes sent, ring steps) of the
    data-parallel side.

    Replicas hold everything and all-reduce the gradients; FSDP2 holds a 1/dp shard of each,
    all-gathers every unit's parameters in forward and again in backward (resharded after
    forward) and reduce-scatters its gradients, one unit at a time."""
    w = m.weights
    optimizer = 8 * w.elements + 4 * w.half  # Adam's two fp32 moments + fp32 master copy
    if not train:
        return w.params, 0, 0, 0, 0.0, 0
    if not fsdp:
        sent, steps = ring("all_reduce", w.params, dp)
        return w.params, w.params, optimizer, 0, sent, steps
    shard, elements, half = fsdp_shard_bytes(w, dp)
    gather, gather_steps = ring("all_gather", w.params, dp)
    scatter, scatter_steps = ring("reduce_scatter", w.params, dp)
    return (shard, shard, 8 * elements + 4 * half, 2 * w.largest_unit, 2 * gather + scatter,
            (2 * gather_steps + scatter_steps) * w.units)


def _rows(m: Measured, gpus: int, train: bool, fsdp_options, modes) -> list[Estimate]:
    """Every configuration of one traced degree."""
    dp, out = gpus // m.tp, []
    collectives = [c for c in m.collectives if train or c.phase == "forward"]
    tp_rings = [ring(c.op, c.bytes or 0, m.tp) for c in collectives]
    for fsdp in sorted({f and dp > 1 and train for f in fsdp_options}):  # FSDP over 1: none
        params, grads, opt, unit, sent, steps = _dp_traffic(m, dp, fsdp, train)
        for mode in modes:
            act = m.activations[mode]
            memory = params + m.weights.buffers + (grads + opt + act + unit if train
                                                   else m.kv_cache)
            flops = m.flops * (3 if train else 1) + m.recompute_flops[mode]
            out.append(Estimate(
                m.tp, dp, fsdp, mode, m.sp, params, m.weights.buffers, grads, opt, act, unit,
                m.kv_cache, memory, len(collectives), sum(c.bytes or 0 for c in collectives),
                sum(s for s, _ in tp_rings), sum(n for _, n in tp_rings), sent, steps, flops))
    return out


def price(row: Estimate, cost: CostModel, dtype: torch.dtype) -> Estimate:
    """``row``'s time and fit on ``cost``'s device."""
    compute_s = row.flops / (peak_flops(cost.device, dtype) * cost.compute_efficiency)
    tp_comm_s = ring_seconds(row.tp_sent_bytes, row.tp_ring_steps, cost)
    dp_comm_s = ring_seconds(row.dp_sent_bytes, row.dp_ring_steps, cost)
    capacity = cost.device.memory_gib * 1024**3 * cost.usable_memory
    return replace(row, fits=row.memory_bytes <= capacity, compute_s=compute_s,
                   tp_comm_s=tp_comm_s, dp_comm_s=dp_comm_s,
                   step_s=compute_s + tp_comm_s + dp_comm_s)


def _decide(model: str, gpus: int, dtype: torch.dtype, inputs: list, cost: CostModel,
            measured: list, experts: list) -> Advice:
    rows = [price(r, cost, dtype) for r in measured]
    fitting = [i for i, r in enumerate(rows) if r.fits]
    best = min(fitting, key=lambda i: (rows[i].step_s, rows[i].tp)) if fitting else None
    return Advice(model, gpus, str(dtype).removeprefix("torch."), inputs, cost, rows, best,
                  experts)


def _choices(value, allowed: tuple, name: str) -> tuple:
    """``value`` (one choice or several) as a non-empty tuple of ``allowed`` values."""
    chosen = tuple(value) if isinstance(value, (list, tuple, set)) else (value,)
    bad = [v for v in chosen if v not in allowed]
    if bad or not chosen:
        raise ValueError(f"{name} takes one or more of {allowed}, got {value!r}")
    return chosen


def advise(model: nn.Module, example_inputs, gpus: int, cost: CostModel, *,
           progress: Callable[[str], None] | None = None,
           checkpointing=MODES, fsdp=(False, True), sequence_parallel=(False, True),
           reuse_blocks: bool = True, **options) -> Advice:
    """Estimate every configuration of ``model`` on ``gpus`` GPUs.

    Build ``model`` on the meta device: nothing is allocated. ``example_inputs`` are one
    data-parallel rank's batch at TP 1; at degree d a TP group runs d times that batch (dim 0),
    so the global batch is the same for every degree. ``checkpointing`` (modes of
    ``parallelize``'s ``activation_checkpointing``), ``fsdp`` and ``sequence_parallel`` are the
    choices weighed (FSDP or SP over one rank is none: a degree with one data-parallel or one
    tensor-parallel rank is weighed without; ``experts="expert"``, planned without SP only,
    is weighed without unless SP alone is asked, which its plan refuses); inference weighs
    TP alone. ``options`` are
    ``parallelize``'s other plan options; ``reuse_blocks`` plans three blocks and repeats them
    (the same plan, much faster for a deep model).
    """
    if any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("advise runs the model's graph on meta tensors: build it under "
                         'torch.device("meta") (the CLI does)')
    train = not cost.inference
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    checkpointing = _choices(checkpointing, MODES, "checkpointing") if train else (None,)
    fsdp = _choices(fsdp, (False, True), "fsdp")
    sequence_parallel = _choices(sequence_parallel, (False, True), "sequence_parallel")
    if options.get("experts") == "expert":  # planned without SP only: weigh SP if asked alone
        sequence_parallel = tuple(s for s in sequence_parallel if not s) or sequence_parallel
    rows, experts = [], []
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        for sp in sorted({s and tp > 1 and train for s in sequence_parallel}):  # SP of 1: none
            if progress is not None:
                progress(f"planning for tensor-parallel degree {tp}" + (", SP" if sp else ""))
            inputs = tuple(_repeat(x, tp) for x in example_inputs)
            trace = trace_rewrite(model, inputs, tp, 0, dynamic=False, reuse_blocks=reuse_blocks,
                                  options=PlanOptions(sequence_parallel=sp, **options))
            rows += _rows(measure_trace(trace, inputs, checkpointing, train), gpus, train,
                          fsdp, [mode_name(m) for m in checkpointing])
            experts += expert_choices(trace) if tp > 1 and not sp else []
    shapes = [list(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
    return _decide(type(model).__name__, gpus, dtype, shapes, cost, rows, experts)
