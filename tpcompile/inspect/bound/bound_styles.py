"""Megatron's styles: which matmuls of a block the bound splits colwise or rowwise, and which
it keeps whole, each with its reason (the "Styles" of :mod:`tpcompile.inspect.bound.bound`'s
definition).

:func:`unpaid_matmuls` judges the per-sample matmuls by the planner's cost rule first, so that
one kept whole starts no chain; :func:`roles` then styles every matmul in graph order (rowwise
where its activation depends on a colwise output) and keeps whole the colwise cuts that could
not stand: no rowwise matmul downstream, fewer heads than ranks, features that do not divide,
a router gate, the narrow side of a low-rank pair.
"""

from __future__ import annotations

from torch import fx

from tpcompile.core.capture import Capture
from tpcompile.inspect.bound.bound_graph import Matmul, reach_forward
from tpcompile.passes.planner.chain_cost import chain_cost, per_sample_chain, pricing

__all__ = ["is_up_of_row", "roles", "unpaid_matmuls", "whole_rows"]


def roles(mms: list[Matmul], world_size: int, layer: str,
           unpaid: dict, around: bool = False) -> tuple[dict, dict]:
    """matmul node -> colwise | rowwise | whole, and the reason of each whole one (``unpaid``:
    the per-sample matmuls kept whole by cost, with theirs; ``around``: the code around a
    model's repeated blocks, where a norm over a projection's cut features keeps it whole)."""
    role, why = {}, {}
    for m in mms:
        if m.node in unpaid:
            role[m.node], why[m.node] = "whole", unpaid[m.node]
            continue
        if m.router:
            role[m.node], why[m.node] = "whole", "a router gate (its output picks experts by topk)"
            continue
        if m.up_of is not None:  # the pair's style was set at its down factor
            continue
        upstream = {role[u] for u in m.upstream if u in role}
        style = "rowwise" if "colwise" in upstream else "colwise"
        if m.up is not None and (style == "colwise" or _summed_with_row(m, mms, layer)):
            role[m.node] = "whole" if style == "colwise" else "rowwise"
            role[m.up] = "colwise" if style == "colwise" else "whole"
            why[m.up if style == "rowwise" else m.node] = (
                "the narrow side of a low-rank pair (Megatron splits the wide factor)")
            continue
        if around and style == "colwise" and m.statistics:
            role[m.node], why[m.node] = "whole", (
                "around the blocks, a norm over its output features reads them whole (an LM "
                "head's transform: Megatron-LM keeps its dense and LayerNorm whole)")
            continue
        role[m.node] = style
        if m.up is not None:  # reduced before its up factor, which starts a chain (Mamba's
            role[m.up] = "colwise"  # x_proj -> dt_proj)
    for m in mms:  # a colwise cut that reaches no rowwise matmul, or does not divide
        if role.get(m.node) != "colwise":
            continue
        if not any(role.get(d) == "rowwise" or (role.get(d) == "whole" and is_up_of_row(d, mms, role))
                   for d in m.downstream):
            role[m.node], why[m.node] = "whole", "its output reaches no row-parallel matmul"
        elif m.heads is not None and m.heads < world_size and not _chunks(m):
            role[m.node], why[m.node] = "whole", (
                f"{m.heads} head(s), fewer than the {world_size} ranks")
        elif whole_rows(m, world_size) == m.out_features:
            role[m.node], why[m.node] = "whole", (
                f"every piece of its output has fewer heads than the {world_size} ranks")
        elif m.out_features % world_size:
            role[m.node], why[m.node] = "whole", (
                f"{m.out_features} output features do not divide over {world_size} ranks")
    return role, why


def unpaid_matmuls(cap: Capture, mms: list[Matmul], world_size: int, device_name: str,
            carriers: set, activations: list) -> dict:
    """Per-sample matmuls whose chain does not pay (module docstring), in graph order: one kept
    whole starts no chain, so the next matmul reading it is judged as a chain's start. Priced
    where the model's matmuls (``activations``: all of them, as the planner prices) read token
    rows: a UNet's time embedding around blocks of image rows too."""
    priced = pricing(device_name, world_size, cap.gm, activations)
    if priced is None:
        return {}
    device, batch = priced
    stored = {n.target: n for n in cap.gm.graph.find_nodes(op="get_attr")}
    by_node, unpaid = {m.node: m for m in mms}, {}
    for m in mms:
        if not per_sample_chain([m.activation], batch) or any(
                u in by_node and u not in unpaid for u in m.upstream):
            continue  # on token rows, or the row-parallel end of another chain
        rows = [by_node[d] for d in m.downstream if d in by_node]
        weights = [stored[w] for w in m.weights + m.biases + [w for r in rows for w in r.weights]
                   if w in stored]
        synced = [m.activation] if m.activation in carriers else []
        cost = chain_cost([m.node] + [r.node for r in rows], weights,
                          [r.node for r in rows] + synced, batch, world_size, device)
        if not cost.pays:
            unpaid[m.node] = f"kept whole by cost: {cost}"
    return unpaid


def whole_rows(m: Matmul, world_size: int) -> int:
    """Output features of a colwise ``m`` that Megatron keeps whole: the pieces its output is
    cut into (``Matmul.parts``) that are viewed as fewer heads than ranks (a fused qkv's one
    kv head). Their weight rows' gradient is a partial sum: one all-reduce of its own."""
    return sum(f for f, heads in m.parts if heads is not None and heads < world_size)


def _chunks(m: Matmul) -> bool:
    """``m``'s "heads" are chunks it is cut into (``nn.MultiheadAttention``'s q, k and v by
    ``unflatten(-1, (3, E))`` and ``select``): as many equal pieces as the view's heads."""
    return len(m.parts) == m.heads and {f for f, _ in m.parts} == {m.out_features // m.heads}


def _summed_with_row(down: Matmul, mms: list[Matmul], layer: str) -> bool:
    """A rowwise down factor's up factor adds its output to another rowwise matmul's (LoRA on
    a row-parallel linear): the whole up factor carries the partial sum to that one's
    all-reduce."""
    ups = reach_forward(down.up, layer, set())
    return any(ups & reach_forward(m.node, layer, set()) for m in mms
               if m.node not in (down.node, down.up) and m.up_of is None and m.up is None)


def is_up_of_row(node: fx.Node, mms: list[Matmul], role: dict) -> bool:
    """``node`` is the whole up factor of a rowwise low-rank pair."""
    return any(m.up is node and role.get(m.node) == "rowwise" for m in mms)
