"""The planner: propagate placements, refine, and freeze the result into a ShardingPlan.

``plan_sharding`` is a driver. It propagates placements through the rule table
(:mod:`tpcompile.passes.planner.propagate`), asks the stages of refinements
(:data:`tpcompile.passes.planner.refine.REFINEMENTS`, one file each, in the order and for the
reasons that package states) and adds the first stage's non-empty decision to its
constraints, then propagates again, until no refinement has anything to add. Then
:mod:`tpcompile.passes.planner.freeze` reads the settled state into the plan: parameters
whose every use wants the same shard are sharded themselves (instead of being sliced at each
use), and replicated values whose gradient arrives as per-rank partial sums are marked for a
gradient all-reduce (Megatron's *f*), one per value however many consumers
(:mod:`tpcompile.passes.planner.grad_syncs`). The steps of
:data:`~tpcompile.passes.planner.refine.FINISH` finish that plan.
"""

from __future__ import annotations

import logging

from torch import fx

from tpcompile.core.capture import Capture
from tpcompile.core.plan import PlanOptions, ShardingPlan
from tpcompile.errors import TPCompileError
from tpcompile.passes.planner.freeze import freeze
from tpcompile.passes.planner.grad_syncs import values_with_grad
from tpcompile.passes.planner.propagate import Constraints, Propagation, propagate
from tpcompile.passes.planner.refine import FINISH, REFINEMENTS, Decision

log = logging.getLogger(__name__)

__all__ = ["plan_sharding"]

MAX_ROUNDS = 64


def plan_sharding(cap: Capture, world_size: int,
                  options: PlanOptions = PlanOptions()) -> tuple[ShardingPlan, dict[fx.Node, str]]:
    """Choose column / row / vocabulary / replicated placements for every weight of ``cap.gm``.

    Returns the plan, and the ops with no rule that met a sharded or partial input in any
    round, with why (the pipeline decomposes them and plans again).
    """
    if world_size < 1:
        raise TPCompileError(f"world_size must be >= 1, got {world_size}")
    gm = cap.gm
    # an inference-only capture refuses every call a backward could follow: no value needs grad
    needs_grad = frozenset() if cap.inference_only else frozenset(values_with_grad(gm, cap.trainable))
    constraints = Constraints(cap.params, options, seq_len=_sequence_length(cap, options),
                              needs_grad=needs_grad)
    no_rule: dict[fx.Node, str] = {}
    for _ in range(MAX_ROUNDS):
        state = propagate(gm, world_size, constraints)
        no_rule.update(state.no_rule)
        decision = next(filter(None, (_decided(stage, gm, state, constraints)
                                      for _, stage in REFINEMENTS)), None)
        if decision is None:
            break
        decision.apply(constraints)
    else:
        log.warning("tpcompile: planner did not settle after %d rounds", MAX_ROUNDS)
    plan = freeze(cap, state, constraints)
    for step in FINISH:
        plan = step(gm, state, plan)
    no_rule.update(state.no_rule)  # freeze's trial cuts of quantized weights add theirs
    return plan, no_rule


def _decided(stage, gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """A stage's refinements' decisions, merged in order."""
    decision = Decision()
    for refine in stage:
        decision |= refine(gm, state, constraints)
    return decision


def _sequence_length(cap: Capture, options: PlanOptions) -> int | None:
    """Dim 1 of the first input with one: what sequence parallelism cuts."""
    if not options.sequence_parallel:
        return None
    for shape_, _ in cap.input_specs:
        if len(shape_) >= 2:
            return int(shape_[1])
    raise TPCompileError("sequence_parallel needs an input with a sequence dim (dim 1), "
                         f"got input shapes {[s for s, _ in cap.input_specs]}")
