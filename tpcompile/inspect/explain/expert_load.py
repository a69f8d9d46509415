"""``explain``'s per-rank expert load: the rows of the example batch routed to each rank's experts.

Expert parallelism's cost is its busiest rank (``passes/planner/experts/cost.py`` prices it
from uniform routing); this is the load the example batch itself puts on each rank. The model
runs once on the example inputs (no gradient) under a dispatch mode that reads the offsets of
every grouped matmul (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``): the first
of each MoE block (its gate and up projection) gives the rows routed to each expert, summed
over the experts each rank holds under whole experts (``RootSpec``'s blocks: the first ranks
take one more when the count does not divide). Under expert-TP every rank multiplies every
row; the split is then what whole experts would load. A model on the meta device has no
routing to read: no load is reported.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from tpcompile.core.placement import RootSpec
from tpcompile.passes.planner.rules import is_grouped_matmul, rule_for_target, viewed_from

__all__ = ["expert_loads"]


class _Offsets(TorchDispatchMode):
    """Records the offsets of each grouped matmul the model runs, in call order. Higher-order
    ops (flex attention) come here too and run as they are: no grouped matmul is inside one."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = rule_for_target(func)
        if rule is not None and rule.grouped:
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            self.seen.append(offs.detach().clone())
        return func(*args, **kwargs)


def _blocks(gm: fx.GraphModule) -> list[str | None]:
    """Per grouped matmul of the capture, in graph order: its MoE module, or None after the
    block's first."""
    out, seen = [], set()
    for node in gm.graph.nodes:
        if is_grouped_matmul(node):
            w = node.args[1]
            module = str(([*reversed(viewed_from(w)), w])[0].target).rpartition(".")[0]
            out.append(None if module in seen else module)
            seen.add(module)
    return out


def expert_loads(model, inputs: tuple, kwargs: dict | None, gm: fx.GraphModule,
                 world_size: int) -> dict[str, list[int]]:
    """MoE module -> rows of the example routed to each rank's whole experts ({} on meta, or
    when the model's grouped matmuls do not match the capture's one for one), or why they were
    not measured when the example does not run here (an attention kernel this device lacks)."""
    blocks = _blocks(gm)
    if not blocks or any(p.device.type == "meta" for p in model.parameters()):
        return {}
    mode = _Offsets()
    try:
        # code the model compiles itself (torchtitan's flex attention) runs eagerly under the mode
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), mode:
            model(*inputs, **(kwargs or {}))
    except (RuntimeError, NotImplementedError) as e:
        why = f"not measured: the example does not run here ({type(e).__name__}: {_first_line(e)})"
        return {module: why for module in blocks if module is not None}
    if len(mode.seen) != len(blocks):
        return {}
    out = {}
    for module, offs in zip(blocks, mode.seen):
        if module is None:
            continue
        bounds = [0, *offs.tolist()]
        spec = RootSpec.build(f"{module}[experts]", len(offs), world_size, [])
        out[module] = [sum(bounds[stop] - bounds[start] for start, stop in owned)
                       for owned in spec.owned]
    return out


def _first_line(e: BaseException) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return line if len(line) <= 160 else line[:157] + "..."
