"""The pipeline, declared once: capture -> prepare passes -> planner -> rewrite passes.

``parallelize``, ``explain`` / ``diff``, the benchmarks and the tests all run these lists
through :func:`plan` and :func:`rewrite`, so what is inspected is what runs:

- :data:`PREPARE_PASSES` edit the freshly captured graph into the form the planner reads
  (nobody else holds that graph yet); :func:`plan` then freezes a :class:`ShardingPlan`.
  :data:`REPLAN_PASSES` run after the planner: while one of them changes the graph (an op
  with no rule decomposed into ops that have one), the planner runs again.
- :data:`REWRITE_PASSES` turn that graph into one rank's graph. :func:`rewrite` works on a
  copy (sharing the weights), so the planned graph stays as the plan describes it: every rank
  of a fake-PG test, and ``explain`` after ``diff``, can rewrite it again.
- :data:`OUTLINE_PASSES` run on ``parallelize``'s rank graph after the ranks agree on it
  (:func:`outline`): the agreement compares the graph's collectives, which an activation-
  checkpointed region outlined into a ``checkpoint`` call would hide. ``explain`` and
  ``diff`` show the graph before them (``explain`` names the regions they checkpoint).

``retarget_device`` runs once more outside the lists, in another phase: a model built on the
meta device gets real shards (``tpcompile.state.meta_init.to_empty``) long after its pipeline
ran, and only then is the device its graph's constants name known.

The runner lints after each pass and turns any failure into a :class:`TPCompileError` naming
the pass, the passes before it and the cause. It regenerates Python code once, after the last
pass (or after each when recording needs the code), and only if some pass changed the graph:
code generation is most of a pass pipeline's time on a large graph (0.07-0.1 s per recompile
at 2,000 nodes), and no pass reads it. A pass says whether it changed the graph by returning
fx's :class:`~torch.fx.passes.infra.pass_base.PassResult`; one returning the graph module
itself is taken to have changed it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import time
import types
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassResult

from tpcompile.core.capture import Capture, capture
from tpcompile.core.plan import PlanOptions, ShardingPlan
from tpcompile.core.stamp import capture_reusing_blocks
from tpcompile.errors import CaptureError, TPCompileError
from tpcompile.passes.prepare.constant_index_as_slice import constant_index_as_slice_pass
from tpcompile.passes.prepare.decompose_unruled import MAX_ROUNDS, decompose_unruled_pass
from tpcompile.passes.prepare.drop_dead_code import drop_dead_code_pass
from tpcompile.passes.prepare.functionalize_fresh_writes import functionalize_fresh_writes_pass
from tpcompile.passes.prepare.inline_autocast import inline_autocast_pass
from tpcompile.passes.prepare.split_bias import split_bias_pass
from tpcompile.passes.planner.plan_sharding import plan_sharding
from tpcompile.passes.planner.unapplied_options import announce, unapplied_options
from tpcompile.passes.rewrite.checkpoint_regions import checkpoint_regions_pass
from tpcompile.passes.rewrite.clone_converted_writes import clone_converted_writes_pass
from tpcompile.passes.rewrite.drop_unowned_experts import drop_unowned_experts_pass
from tpcompile.passes.rewrite.fuse_bias import fuse_bias_pass
from tpcompile.passes.rewrite.fuse_sequence_linears import fuse_sequence_linears_pass
from tpcompile.passes.rewrite.insert_collectives import insert_collectives_pass
from tpcompile.passes.rewrite.localize import localize_pass
from tpcompile.passes.rewrite.materialize_params import materialize_params_pass
from tpcompile.passes.rewrite.retarget_device import retarget_device_pass
from tpcompile.runtime.module import TPModule

__all__ = ["Pass", "PassRecord", "Planned", "PREPARE_PASSES", "REPLAN_PASSES", "REWRITE_PASSES",
           "OUTLINE_PASSES", "plan", "rewrite", "rewrite_passes", "outline", "run_passes",
           "older_objects_frozen", "steps"]

# a pass returns its graph, a PassResult, or a PassResult and what it found (the record's facts)
Pass = tuple[str, Callable[[fx.GraphModule], fx.GraphModule | PassResult | tuple[PassResult, object]]]


# graph -> graph, before the planner: the planner sees the ops of autocast scopes, no dead
# code, matmuls without biases, constant runs of indices as slices, and writes into buffers
# the graph makes itself as values (out of place)
PREPARE_PASSES: list[Pass] = [("inline_autocast", inline_autocast_pass),
                              ("drop_dead_code", drop_dead_code_pass),
                              ("split_bias", split_bias_pass),
                              ("constant_index_as_slice", constant_index_as_slice_pass),
                              ("functionalize_fresh_writes", functionalize_fresh_writes_pass)]
# graph -> graph after each planner run, given what the planner returned; the planner runs
# again while one changes the graph (at most MAX_ROUNDS times)
REPLAN_PASSES: list[tuple[str, Callable[..., fx.GraphModule | PassResult], tuple[str, ...]]] = [
    ("decompose_unruled", decompose_unruled_pass, ("no_rule",)),  # ops with no rule, decomposed
]
# one rank's rewrite, in order: (name, pass, the parts of the rank's context it takes)
REWRITE_PASSES: list[tuple[str, Callable[..., fx.GraphModule], tuple[str, ...]]] = [
    ("localize", localize_pass, ("plan", "rank", "group")),  # per-rank ops, shape constants
    ("insert_collectives", insert_collectives_pass, ("plan", "rank", "group")),  # conversions
    ("drop_unowned_experts", drop_unowned_experts_pass, ("plan", "rank")),  # others' experts
    ("clone_converted_writes", clone_converted_writes_pass, ("plan",)),  # in-place writes local
    ("materialize_params", materialize_params_pass, ("plan", "rank")),  # this rank's shards
    ("fuse_bias", fuse_bias_pass, ()),                       # linear(x, W) + b -> linear(x, W, b)
    ("fuse_sequence_linears", fuse_sequence_linears_pass, ()),  # one SP gather for its linears
    ("retarget_device", retarget_device_pass, ("device",)),  # a meta capture's device constants
]
# parallelize's rank graph once the ranks agree on it: checkpointed regions outlined
OUTLINE_PASSES: list[tuple[str, Callable[..., PassResult], tuple[str, ...]]] = [
    ("checkpoint_regions", checkpoint_regions_pass, ("checkpointing",)),
]


def steps() -> list[tuple[str, Callable]]:
    """Every step in the order it runs: capture, the prepare passes, the planner, the replan,
    rewrite and outline passes (the maps docs/generate.py writes into the docs)."""
    return ([("capture", capture), *PREPARE_PASSES, ("plan_sharding", plan_sharding)]
            + [(name, fn) for name, fn, _ in REPLAN_PASSES + REWRITE_PASSES + OUTLINE_PASSES])


@dataclass
class PassRecord:
    name: str
    seconds: float
    before: str = field(repr=False, default="")
    after: str = field(repr=False, default="")
    changed: bool = True
    facts: object = field(repr=False, default=None)  # what the pass returned beside its graph


@dataclass(frozen=True)
class Planned:
    """A captured model after the prepare and replan passes, and its plan."""
    cap: Capture                 # cap.gm is the planned graph: the plan's node names are its own
    plan: ShardingPlan
    records: tuple[PassRecord, ...] = ()   # the prepare and replan passes'
    seconds: dict[str, float] = field(default_factory=dict)  # capture, prepare, planner + replans


@contextlib.contextmanager
def older_objects_frozen():
    """Garbage collections inside the block skip the objects that existed before it.

    A full collection walks every object the process tracks. After torch.export that is
    millions (fake tensors, sympy expressions, the model), about 0.2 s per collection on a
    7B-shaped graph, and one landing inside planning or the rewrite doubled its time. What the
    block allocates is collected as usual. A process that froze objects itself (``gc.freeze``
    before forking workers) is left as it is: unfreezing would undo its own freeze.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_passes(gm: fx.GraphModule, passes: list[Pass],
               record: bool | Callable[[fx.GraphModule], str] = False):
    """Run ``passes`` on ``gm``; returns ``(gm, records)`` with the code before/after each.

    ``record``: True keeps ``gm.code``; a callable ``gm -> str`` keeps its own rendering (the
    diff annotates parameter shapes, which ``gm.code`` does not show).
    """
    if callable(record):
        snapshot = record
    else:
        def snapshot(g: fx.GraphModule) -> str:
            return g.code if record else ""
    records = []
    stale = False  # the graph changed since gm's code was generated
    for i, (name, fn) in enumerate(passes):
        before = snapshot(gm)
        start = time.perf_counter()
        try:
            out, changed, facts = fn(gm), True, None
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], PassResult):
                (out, changed), facts = out
            elif isinstance(out, PassResult):
                out, changed = out
            assert isinstance(out, fx.GraphModule), f"pass returned {type(out).__name__}"
            out.graph.lint()
            stale = stale or changed
            if stale and (record or i == len(passes) - 1):
                out.recompile()
                stale = False
        except TPCompileError:
            raise
        except Exception as e:  # noqa: BLE001 - wrapped with the pass context, cause kept
            done = [n for n, _ in passes[:i]]
            raise TPCompileError(
                f"internal error in pass '{name}' (after {done}): {type(e).__name__}: {e}\n"
                "  hint: this is a tpcompile bug; please report it with `tpcompile explain` "
                "output for your model") from e
        gm = out
        records.append(PassRecord(name, time.perf_counter() - start, before, snapshot(gm), changed,
                                  facts))
    return gm, records


def plan(model: nn.Module, example_inputs, world_size: int, example_kwargs=None, *,
         options: PlanOptions = PlanOptions(), dynamic: bool = True, stack_traces: bool = False,
         reuse_blocks: bool = True, record: bool | Callable[[fx.GraphModule], str] = False,
         progress: Callable[[str], None] = lambda message: None) -> Planned:
    """Capture ``model``, run :data:`PREPARE_PASSES`, and plan for ``world_size`` ranks.

    ``progress`` receives a line once the graph is captured (planning a large model takes a
    while after that). ``stack_traces``: keep model lines in the graph, for the planner's
    reasons (a sixth of export's time, so inspection asks for it and ``parallelize`` does not).
    ``reuse_blocks`` (default): export three of the model's identical blocks (or groups of
    blocks) and repeat block 2's graph for the others (:mod:`tpcompile.core.stamp`): the same
    graph and plan, in a time that hardly grows with depth; blocks that differ are captured
    whole, with a note in the plan saying why. False always captures the whole model.
    """
    if isinstance(model, TPModule):
        raise CaptureError(
            f"the model is already parallelized (a TPModule holding rank {model.rank}'s shards)"
            "\n  hint: call parallelize on the original model (parallelize leaves it untouched), "
            "not on its result")
    t0 = time.perf_counter()
    cap = (capture_reusing_blocks if reuse_blocks else capture)(
        model, example_inputs, example_kwargs, dynamic=dynamic,
        static_dims=options.static_dims, stack_traces=stack_traces)
    t1 = time.perf_counter()
    progress(f"captured {len(cap.gm.graph.nodes)} graph nodes in {t1 - t0:.1f}s; planning for "
             f"{world_size} ranks")
    with older_objects_frozen():
        gm, records = run_passes(cap.gm, PREPARE_PASSES, record=record)
        cap = replace(cap, gm=gm)
        t2 = time.perf_counter()
        sharding, replanned = _plan_until_settled(cap, world_size, options, record)
    sharding = announce(sharding, unapplied_options(cap.gm, sharding), stacklevel=2)
    seconds = {"capture": t1 - t0, "planning_passes": t2 - t1,
               "plan_sharding": time.perf_counter() - t2}
    return Planned(cap, sharding, tuple(records + replanned), seconds)


def _plan_until_settled(cap: Capture, world_size: int, options: PlanOptions,
                        record) -> tuple[ShardingPlan, list[PassRecord]]:
    """The planner, then :data:`REPLAN_PASSES`, repeated while those change the graph.

    Returns the last plan and one record per replan pass, spanning its rounds.
    """
    sharding, no_rule = plan_sharding(cap, world_size, options)
    rounds: list[list[PassRecord]] = []
    for _ in range(MAX_ROUNDS):
        _, records = run_passes(cap.gm, _bound(REPLAN_PASSES, {"no_rule": no_rule}), record=record)
        rounds.append(records)
        if not any(r.changed for r in records):
            break
        sharding, no_rule = plan_sharding(cap, world_size, options)
    merged = []
    for each in zip(*rounds):  # one pass's records, round by round; facts: each round's
        merged.append(PassRecord(each[0].name, sum(r.seconds for r in each), each[0].before,
                                 each[-1].after, any(r.changed for r in each),
                                 tuple(r.facts for r in each)))
    return sharding, merged


def rewrite_passes(plan: ShardingPlan, rank: int, group_name: str,
                   device: torch.device | None = None) -> list[Pass]:
    """:data:`REWRITE_PASSES` bound to one rank, each named so it can be diffed on its own.

    ``device``: where the rank's tensors live when the graph was captured on the meta device
    (a copy of the model without weights); None leaves device constants as captured.
    """
    return _bound(REWRITE_PASSES, {"plan": plan, "rank": rank, "group": group_name,
                                   "device": device})


def _bound(passes, context: dict) -> list[Pass]:
    """``(name, pass, takes)`` entries as runnable passes given the parts of ``context`` each
    takes."""
    return [(name, functools.partial(fn, **{k: context[k] for k in takes}))
            for name, fn, takes in passes]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its own graph and module tree, sharing ``gm``'s tensors.

    The rewrite edits the graph and replaces weights by shards (in the copy's own parameter
    dicts); ``gm`` keeps its graph, its weights and its Python class (a GraphModule's code lives
    on a class of its own, so the copy gets a new one). Tensors are shared, not copied: a copy
    of a 70B model's weights is what this avoids.
    """
    copied = fx.GraphModule.__new__(type(gm))
    copied.__dict__.update(gm.__dict__)
    for key, value in gm.__dict__.items():  # export binds train/eval to the module: rebind
        if isinstance(value, types.MethodType) and value.__self__ is gm:
            copied.__dict__[key] = types.MethodType(value.__func__, copied)
    _own_containers(copied)
    copied.meta = dict(gm.meta)
    # the codegen (the call's pytree specs) is shared, not copied: it is never edited, and a
    # flex-attention BlockMask input's spec holds its mask_mod's globals (modules do not copy)
    codegen, gm.graph._codegen = gm.graph._codegen, fx.graph.CodeGen()
    try:
        graph = copy.deepcopy(gm.graph)  # nodes' meta dicts are copied, values shared
    finally:
        gm.graph._codegen = codegen
    graph._codegen = codegen
    # Not ``copied.graph = graph``: that setter regenerates the code, a third of the copy's time
    # on a large graph. The graph is gm's, so gm's code and forward are the copy's until the
    # rewrite's passes edit the graph and ``run_passes`` recompiles it.
    copied._graph, graph.owning_module = graph, copied
    type(copied).forward = type(gm).forward
    return copied


def _own_containers(module: nn.Module) -> None:
    """Give ``module`` and its submodules their own parameter, buffer and module dicts."""
    for key in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
        module.__dict__[key] = copy.copy(module.__dict__[key])
    children = {}
    for name, child in module._modules.items():
        if child is not None:
            child = copy.copy(child)
            _own_containers(child)
        children[name] = child
    module.__dict__["_modules"] = children


def rewrite(planned: Planned, rank: int, group_name: str, *,
            record: bool | Callable[[fx.GraphModule], str] = False,
            skip: tuple[str, ...] = (),
            device: torch.device | None = None) -> tuple[fx.GraphModule, list[PassRecord]]:
    """One rank's graph: :data:`REWRITE_PASSES` on a copy of the planned graph.

    ``skip``: pass names left out (``explain`` skips ``materialize_params``: it needs the
    graph, not a copy of every weight of a real 7B model). ``device``: see
    :func:`rewrite_passes`.
    """
    passes = [p for p in rewrite_passes(planned.plan, rank, group_name, device)
              if p[0] not in skip]
    with older_objects_frozen():
        return run_passes(copy_graph(planned.cap.gm), passes, record=record)


def outline(gm: fx.GraphModule,
            checkpointing: str | None) -> tuple[fx.GraphModule, list[PassRecord]]:
    """:data:`OUTLINE_PASSES` on a rank's rewritten graph (in place); ``checkpointing`` is
    ``parallelize``'s ``activation_checkpointing``. The ``checkpoint_regions`` record's
    ``facts`` are the regions it checkpointed and those it left inline, with why."""
    return run_passes(gm, _bound(OUTLINE_PASSES, {"checkpointing": checkpointing}))
