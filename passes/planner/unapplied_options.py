"""Options that did nothing: each named in a warning and a plan note, with the reason.

A user who asks for vocabulary parallelism and gets a whole embedding table has a plan that is
correct but not the one asked for; issue #44's rule is that such an outcome is never silent.
Which options applied is judged here, in one place, from the finished plan (and, for
``activation_checkpointing``, from the regions the rank graph kept): the planner's passes
decide, this module only reads what they decided.

- ``vocab_parallel``: no table ``embedding`` reads token ids from is cut by vocabulary rows
  (no such lookup, or every table kept whole for a reason the plan names).
- ``loss_parallel``: no output of the model is left sharded.
- ``sequence_parallel``: no row-parallel sum is reduce-scattered (no column -> row chain).
- ``experts``: ``"expert"`` or ``"auto"`` on a model without stacked or looped experts.
- ``activation_checkpointing``: ``"full"`` or ``"selective"`` found no repeated block.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from torch import fx

from tpcompile.core.placement import Partial, Shard
from tpcompile.core.plan import PlanOptions, ShardingPlan
from tpcompile.passes.planner.rules.vocabulary import token_tables

__all__ = ["unapplied_options", "unapplied_checkpointing", "announce"]


def _vocab(gm: fx.GraphModule, plan: ShardingPlan) -> str | None:
    """Why ``vocab_parallel`` cut no table, or None when it cut one."""
    tables = [plan.params[t] for t in token_tables(gm) if t in plan.params]
    if not tables:
        return "the model has no embedding table looked up by token ids from its inputs"
    if any(e.style == "vocab" for e in tables):
        return None
    whys = [f"{e.name}: {plan.replicated.get(e.name, e.reason)}" for e in tables]
    return "no embedding table was cut by vocabulary rows: " + "; ".join(whys)


def _sequence(plan: ShardingPlan) -> str | None:
    if any(isinstance(c.src, Partial) and isinstance(c.dst, Shard) for c in plan.conversions):
        return None
    return ("no row-parallel sum is reduce-scattered: the model has no column -> row chain "
            "whose code between chains could run on sequence shards")


def unapplied_options(gm: fx.GraphModule, plan: ShardingPlan) -> list[str]:
    """One line per option of ``plan.options`` that changed nothing, saying why."""
    options, default = plan.options, PlanOptions()
    found = []
    if options.vocab_parallel:
        found.append(("vocab_parallel=True", _vocab(gm, plan)))
    if options.loss_parallel:
        found.append(("loss_parallel=True", None if plan.output_layouts() else
                      "no output of the model is sharded (no column-parallel LM head reaches "
                      "an output); every output is whole"))
    if options.sequence_parallel:
        found.append(("sequence_parallel=True", _sequence(plan)))
    if options.experts != default.experts:
        found.append((f"experts={options.experts!r}", None if plan.experts else
                      "the model has no stacked or looped expert weights"))
    return [f"{option} did not apply: {why}" for option, why in found if why is not None]


def unapplied_checkpointing(mode: str | None, kept: list, dropped: list) -> list[str]:
    """``activation_checkpointing=mode`` that found no repeated block to checkpoint."""
    if mode is None or kept or dropped:
        return []
    return [f"activation_checkpointing={mode!r} did not apply: no repeated blocks (children "
            "of a ModuleList) to checkpoint; nothing is recomputed"]


def announce(plan: ShardingPlan, notes: list[str], stacklevel: int = 2) -> ShardingPlan:
    """Warn once per note (``tpcompile: ...``) and return ``plan`` with the notes added."""
    for note in notes:
        warnings.warn(f"tpcompile: {note}", stacklevel=stacklevel + 1)
    return replace(plan, notes=plan.notes + tuple(n for n in notes if n not in plan.notes))
