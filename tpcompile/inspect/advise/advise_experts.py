"""``advise``'s expert choice: each MoE block's two cuts priced at each tensor-parallel degree.

For every grouped-matmul MoE block of a degree's capture (transformers' Mixtral, Qwen3-MoE,
OLMoE experts), the cost model of ``experts="auto"``
(:func:`~tpcompile.passes.planner.experts.placement.grouped_costs`, the rates of
:mod:`~tpcompile.passes.planner.devices` for the weights' device type: an accelerator's for
a model built on meta) prices expert-TP and whole experts per rank for one training step of the
block on the busiest rank, at the example's routed rows (tokens x top-k) and TP ranks. The
cheaper is what ``experts="auto"`` plans; the plan's own line (what the ``experts`` option
given to ``advise`` made of the block) is kept beside it. Blocks of the same shapes are one
line, with their count.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpcompile.passes.planner.dims import hinted_shape
from tpcompile.passes.planner.experts.placement import grouped_costs
from tpcompile.passes.planner.rules import is_grouped_matmul, viewed_from

__all__ = ["ExpertChoice", "expert_choices", "render_experts"]


@dataclass(frozen=True)
class ExpertChoice:
    """One MoE block at one degree: its shapes, both cuts' estimates, and the cheaper."""

    tp: int
    module: str
    experts: int
    width: int               # each expert's hidden features (gate_up is 2 x width)
    model_width: int
    rows: int                # routed rows per step of the example: tokens x top-k
    tensor_ms: float
    expert_ms: float
    cheaper: str             # "tensor" or "expert": what experts="auto" plans
    planned: str             # the plan's experts line for the block


def expert_choices(trace) -> list[ExpertChoice]:
    """The priced choice of each grouped-matmul MoE block of ``trace`` (one degree), the first
    grouped matmul of a block (its gate and up projection) standing for it."""
    seen, out = set(), []
    tp = trace.plan.world_size
    for node in trace.cap.gm.graph.nodes:
        if not is_grouped_matmul(node):
            continue
        x, w = node.args[0], node.args[1]
        param = ([*reversed(viewed_from(w)), w])[0]
        module = str(param.target).rpartition(".")[0]
        if module in seen or param.op != "get_attr":
            continue
        seen.add(module)
        experts, model_width, out_features = hinted_shape(w)
        costs = grouped_costs(x, w, tp)
        out.append(ExpertChoice(
            tp, module, experts, out_features // 2, model_width, hinted_shape(x)[0],
            1e3 * costs["tensor"].seconds, 1e3 * costs["expert"].seconds,
            min(costs, key=lambda m: costs[m].seconds), trace.plan.experts.get(module, "")))
    return out


def render_experts(choices: list[ExpertChoice]) -> list[str]:
    """The expert section of advise's text: one line per degree and block shape."""
    if not choices:
        return []
    groups: dict[tuple, list[str]] = {}
    for c in choices:
        key = (c.tp, c.experts, c.width, c.model_width, c.rows, c.tensor_ms, c.expert_ms,
               c.cheaper, c.planned.split(":")[0])
        groups.setdefault(key, []).append(c.module)
    lines = ["experts (per MoE block, one training step on the busiest rank: "
             "passes/planner/experts/cost.py; experts=\"auto\" plans the cheaper):"]
    for (tp, e, w, d, rows, t_ms, e_ms, cheaper, planned), modules in groups.items():
        blocks = modules[0] + (f" and {len(modules) - 1} more" if len(modules) > 1 else "")
        lines.append(f"  TP {tp}: {blocks} ({e} experts of width {w}, model width {d}, {rows} "
                     f"routed rows): expert-TP {t_ms:.3g} ms, whole experts {e_ms:.3g} ms -> "
                     f"{'expert parallel' if cheaper == 'expert' else 'expert-TP'}"
                     + (f" (planned: {planned})" if planned else ""))
    return lines
