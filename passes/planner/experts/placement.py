"""Expert placement: how stacked expert weights are cut (``PlanOptions.experts``).

A stacked expert weight is a parameter whose leading dim is a batch dim of its matmul: the
activation and the output carry it too (``bmm(tokens[experts], W[experts].mT)``, Llama 4's
``bmm(routed, gate_up)``, an ``einsum("etd,ehd->eth")``). Under ``experts="tensor"`` it is
cut like any weight, column -> row inside every expert. Under ``experts="expert"`` the column
root starts on that batch dim instead: each rank holds whole experts (``RootSpec``'s uneven
blocks when the count does not divide), the replicated tokens are sliced to the rank's experts
locally, every op after keeps the expert shard, and the sum over experts is a partial sum,
all-reduced once where a consumer needs it whole: the collectives of expert-TP, with whole
experts. Grouped matmuls (``_grouped_mm``: rows picked per expert by offsets, transformers'
MoEs) are planned column -> row and then moved onto their experts when asked
(:func:`grouped_mode`, :mod:`tpcompile.passes.planner.experts.grouped`).

What was chosen for each weight, and why, is recorded during propagation
(:func:`choose_column`, :func:`place_experts`) and frozen per MoE module into
``ShardingPlan.experts`` (:func:`expert_placements`), the lines ``explain`` prints.
"""

from __future__ import annotations

import math

from tpcompile.passes.planner.dims import hinted_shape, shape, val
from tpcompile.passes.planner.devices import device_for
from tpcompile.passes.planner.experts.cost import expert_costs

__all__ = ["choose_column", "expert_label", "grouped_costs", "grouped_mode", "place_experts",
           "expert_placements"]

# experts="auto" under sequence parallelism: the one cut it can plan (PlanOptions refuses "expert")
SEQUENCE_PARALLEL = ("auto: sequence_parallel=True: the tokens reach the block as sequence shards, "
                     "which whole experts could only take through an all-to-all dispatch (not "
                     "implemented), so each expert is split column -> row")


def expert_label(labels, others, out_labels):
    """The expert label of a stacked weight (3-D or more, a matrix per leading index): its
    leading label, kept in the output, with a label the activation contracts behind it.
    The activation carries it too (``bmm`` over expanded tokens) or not (an ``einsum`` that
    broadcasts the tokens over experts, ``"td,ehd->eth"``)."""
    if len(labels) < 3 or labels[0] is None or labels[0] not in out_labels:
        return None
    contracted = any(lab in others and lab not in out_labels for lab in labels[1:])
    return labels[0] if contracted else None


def choose_column(op, w, labels, others, out_labels, column):
    """The label a parameter matmul starts its root on: ``column`` (the weight's output
    features), or its expert dim when ``experts`` asks for whole experts (``"expert"``, or
    ``"auto"`` when :func:`_auto` prefers them) and there are at least as many experts as
    ranks. Records the choice for a stacked weight either way."""
    expert = expert_label(labels, others, out_labels)
    if expert is None:
        return column
    mode, why = op.options.experts, f'experts="{op.options.experts}"'
    count, ranks = int(shape(w)[labels.index(expert)]), op.specs.world_size
    if column == expert:  # the tokens are broadcast over the experts: every mode cuts them
        mode, why = "expert", ("the first dim only the weight and the output carry, which "
                               'experts="tensor" cuts too, is the experts (the tokens are '
                               "broadcast over them)")
    elif mode == "auto" and op.options.sequence_parallel:
        mode, why = "tensor", SEQUENCE_PARALLEL
    elif mode == "auto":
        width = int(shape(w)[labels.index(column)]) if column is not None else None
        mode, why = _auto(count, width, ranks)
    elif mode == "expert" and count < ranks:
        mode, why = "tensor", f"{count} experts: fewer than the {ranks} ranks"
    if mode == "tensor":
        place_experts(op, w, "tensor", why)
        return column
    place_experts(op, w, "expert", f"whole experts per rank ({op.node.name} runs each "
                                   f"rank's experts of {op.param_behind(w).target})"
                  + (f"; {why}" if why != 'experts="expert"' else ""))
    return expert


def grouped_mode(op, w) -> tuple[str, str]:
    """How the experts of a grouped matmul's weight ``w`` (experts, in, out) are asked to be
    cut, and why: ``"rows"`` (whole experts per rank, each multiplying only the rows routed
    to it: the column -> row chain planned as for ``"tensor"`` is moved onto the expert dim
    after planning, :mod:`tpcompile.passes.planner.experts.grouped`) or ``"tensor"``."""
    mode, ranks = op.options.experts, op.specs.world_size
    count = int(shape(w)[0])
    why = f'experts="{mode}"'
    if mode != "tensor" and count < ranks:
        mode, why = "tensor", f"{count} experts: fewer than the {ranks} ranks"
    elif mode == "auto" and op.options.sequence_parallel:
        mode, why = "tensor", SEQUENCE_PARALLEL
    elif mode == "auto":
        mode, why = _auto_grouped(op.node.args[0], w, ranks)
    return ("rows" if mode == "expert" else "tensor"), why


def grouped_costs(x, w, ranks: int) -> dict:
    """Both cuts of the grouped matmul of ``x`` (the routed rows) by ``w`` (experts, model
    width, ``2W``: its output read as gate and up) priced by
    :func:`~tpcompile.passes.planner.experts.cost.expert_costs` for the example's rows on the
    weight's device type and dtype: what ``experts="auto"`` and ``advise`` weigh."""
    experts, model_width, out = hinted_shape(w)
    return expert_costs(experts, out // 2, model_width, hinted_shape(x)[0], ranks,
                        device_for(val(w).device.type), dtype_bytes=val(w).dtype.itemsize)


def _auto_grouped(x, w, ranks: int) -> tuple[str, str]:
    """``experts="auto"`` on a grouped matmul: the cut :func:`grouped_costs` prices lower."""
    costs = grouped_costs(x, w, ranks)
    pick = min(costs, key=lambda m: costs[m].seconds)
    return pick, f"auto: cost model ({costs['tensor']}; {costs['expert']})"


def _auto(experts: int, width: int | None, ranks: int) -> tuple[str, str]:
    """``experts="auto"``'s cost model. Without sequence parallelism both cuts cost the same
    collectives, whatever the token count: one all-reduce of the block's (tokens, model
    width) output forward and one of its input's gradient backward, no all-to-all. What
    differs is the largest rank's share of the experts' weights, and so of their bytes and
    FLOPs: ``ceil(E / N) / E`` whole experts against ``ceil(width / N) / width`` of every
    expert. The smaller share wins; at a tie whole experts do (full-width matmuls, each
    expert's weight gradient computed on one rank)."""
    if experts < ranks:
        return "tensor", f"{experts} experts: fewer than the {ranks} ranks"
    by_expert = math.ceil(experts / ranks) / experts
    if width is None:
        return "expert", "auto: no other output dim to cut"
    by_width = math.ceil(width / ranks) / width
    share = f"largest rank's share {by_expert:.3f} by experts, {by_width:.3f} by width {width}"
    return ("expert" if by_expert <= by_width else "tensor"), f"auto: {share}"


def place_experts(op, w, mode: str, why: str) -> None:
    """Record how the stacked experts behind weight ``w`` are cut (``"expert"``: whole
    experts per rank; ``"tensor"``: each expert split column -> row), and why."""
    op.experts_placed.setdefault(op.param_behind(w).target, (mode, why))


def expert_placements(placed: dict, params: dict) -> dict[str, str]:
    """MoE module -> how its stacked experts ended up cut, and why: a weight whose chain was
    later kept whole is ``replicated`` with the planner's reason."""
    out = {}
    for name, (mode, why) in sorted(placed.items()):
        entry = params.get(name)
        if entry is not None and entry.style == "replicate":
            mode, why = "replicated", entry.reason
        label = {"expert": "expert parallel", "tensor": "tensor parallel"}.get(mode, mode)
        out.setdefault(name.rpartition(".")[0], f"{label}: {why}")
    return out
