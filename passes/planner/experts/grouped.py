"""Whole experts per rank for grouped matmuls (``experts="expert"`` on transformers' MoEs).

A grouped matmul (``_grouped_mm(x, w, offs)``: Mixtral, Qwen3-MoE and OLMoE in transformers
5) picks each row's expert by offsets, so no placement of its operands names the experts:
the planner plans its experts as a column -> row chain (``w_up`` cut on its features, the
activation between sharded alike, ``w_down``'s product a partial sum all-reduced once), and
the grouped rule records when whole experts are asked (``"rows"``,
:func:`tpcompile.passes.planner.experts.placement.grouped_mode`). This step then moves that
chain onto the expert dim, keeping its collectives:

- every weight of the chain is cut on dim 0 into whole experts (``RootSpec``'s blocks: the
  first ranks take one more when the count does not divide);
- the chain's feature root is held whole on every rank: between the grouped matmuls each
  rank holds every row and feature, zero on the rows routed to other ranks' experts;
- each grouped matmul multiplies the rank's rows only (their bounds read from the offsets at
  run time, :mod:`tpcompile.runtime.routed_rows`), so the last one's output is a partial
  sum of disjoint rows, all-reduced where the chain's was.

The compute trade: the rows cannot be cut statically (the routing decides how many each
expert gets), so the tensors between the matmuls keep every row; the matmuls skip other
ranks' rows, the elementwise ops between them (the gate's activation and product) run over
all rows, and each grouped matmul reads its rows' bounds on the host once per call.

The chain stays tensor parallel, with the reason in the plan's ``experts``, when anything
but the grouped matmuls' weights is cut with it (a per-expert bias added to every row would
land on other ranks' rows), when its matmuls read different offsets or expert counts, or
when a conversion reads a value of the chain (only its partial sum may be converted).
"""

from __future__ import annotations

from dataclasses import replace

from torch import fx

from tpcompile.core.placement import Layout, RootSpec, Shard, Specs
from tpcompile.core.plan import ShardingPlan
from tpcompile.passes.planner.dims import shape
from tpcompile.passes.planner.rules import is_grouped_matmul, shard_map, viewed_from

__all__ = ["whole_grouped_experts"]


def whole_grouped_experts(gm: fx.GraphModule, state, plan: ShardingPlan) -> ShardingPlan:
    """``plan`` with every grouped-matmul chain whose experts were asked whole
    (``state.experts``: weight -> (mode, why), propagation's records) cut by experts, or left
    tensor parallel with the reason."""
    placed = state.experts
    chains = _grouped_chains(gm, plan)
    asked = {root: nodes for root, nodes in chains.items()
             if placed.get(root, ("",))[0] == "rows"}
    if not asked:
        return plan
    roots, placements = dict(plan.roots), dict(plan.placements)
    params, experts = dict(plan.params), dict(plan.experts)
    for root, nodes in asked.items():
        module = root.rpartition(".")[0]
        count = int(shape(nodes[0].args[1])[0])
        layout = Layout(f"{root}[experts]", count)
        cut = _expert_placements(nodes, layout)
        why = _refusal(plan, root, nodes) or (None if cut else
                                              "a view of its weights does not keep the experts")
        if why is not None:
            experts[module] = f"tensor parallel: {why}"
            continue
        roots[layout.root] = RootSpec.build(layout.root, count, plan.world_size, [])
        spec = roots[root]
        roots[root] = replace(spec, blocks=tuple(replace(b, replicated=True) for b in spec.blocks))
        specs = Specs(plan.world_size, roots)
        for node, p in cut.items():
            placements[node.name] = p
            if node.op == "get_attr":
                e = params[node.target]
                local = tuple(specs.local_size(layout, r) for r in range(plan.world_size))
                params[node.target] = replace(
                    e, style="expert", placement=p,
                    local_shapes=tuple((n, *e.global_shape[1:]) for n in local),
                    reason=f"expert in {_reader(node).name}: whole experts per rank")
        names = " and ".join(n.name for n in nodes)
        experts[module] = (f"expert parallel: whole experts per rank ({names} multiply only the "
                           f"rows routed to the rank's experts); {placed[root][1]}")
    return replace(plan, roots=roots, placements=placements, params=params, experts=experts)


def _grouped_chains(gm: fx.GraphModule, plan: ShardingPlan) -> dict[str, list[fx.Node]]:
    """Feature root -> the grouped matmuls whose weight is cut on it."""
    chains: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if not is_grouped_matmul(node):
            continue
        w = node.args[1]
        p = plan.converted.get((w.name, node.name), plan.placement(w.name))
        if isinstance(p, Shard) and len(shape(w)) == 3:
            chains.setdefault(p.layout.root, []).append(node)
    return chains


def _weight_chain(node: fx.Node) -> list[fx.Node]:
    """The parameter behind a grouped matmul's weight, then each view of it up to the matmul."""
    w = node.args[1]
    return [*reversed(viewed_from(w)), w]


def _reader(param: fx.Node) -> fx.Node:
    """The grouped matmul a weight's views lead to."""
    node = param
    while len(node.users) == 1 and not is_grouped_matmul(node):
        node = next(iter(node.users))
    return node


def _expert_placements(nodes: list[fx.Node], layout: Layout) -> dict[fx.Node, Shard] | None:
    """Each weight and view of it cut on its expert dim, or None where a view moves that dim
    off dim 0 of what the grouped matmul reads."""
    out = {}
    for node in nodes:
        chain = _weight_chain(node)
        if chain[0].op != "get_attr":
            return None
        p = Shard(0, layout)
        out[chain[0]] = p
        for view in chain[1:]:
            p = shard_map(view)(view, p)
            if not isinstance(p, Shard):
                return None
            out[view] = p
        if p.dim != 0:
            return None
    return out


def _refusal(plan: ShardingPlan, root: str, nodes: list[fx.Node]) -> str | None:
    """Why the chain of ``root`` cannot be cut by experts, or None."""
    weights = {_weight_chain(n)[0].target for n in nodes}
    others = sorted(name for name, e in plan.params.items()
                    if isinstance(e.placement, Shard) and e.placement.layout.root == root
                    and name not in weights)
    if others:
        return f"{', '.join(others)} cut with its experts' features, no expert weight"
    if len({_offsets(n) for n in nodes}) > 1:
        return f"{', '.join(n.name for n in nodes)} read different offsets"
    if len({int(shape(n.args[1])[0]) for n in nodes}) > 1:
        return f"{', '.join(n.name for n in nodes)} hold different expert counts"
    for c in plan.conversions:
        if any(isinstance(p, Shard) and p.layout.root == root for p in (c.src, c.dst)):
            return f"{c.user} reads {c.value} converted ({c.kind})"
    return None


def _offsets(node: fx.Node) -> fx.Node:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
