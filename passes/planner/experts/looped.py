"""Whole experts per rank for looped experts (``experts="expert"`` on a ``ModuleList`` loop).

Mixtral-style code keeps one module per expert and loops over them: each expert's tokens are
picked by index, run through its MLP, and added back (``out.index_add_(0, idx, y)``, litgpt's
``y[idx] += probs * expert(x[idx])``). Export unrolls the loop, so each expert is a column ->
row chain of its own, and the planner cuts every one of them like any MLP: its features over
the ranks, its product a partial sum that the combine accumulates and that is all-reduced once
per block (``experts="tensor"``). This step then hands each expert whole to one rank:

- the experts of one block are the column roots whose partial sums reach the same reduction
  and whose weights all live under ``<container>.<i>.`` (the ``ModuleList`` and the expert's
  index); a root with weights elsewhere (a shared expert) stays as planned;
- expert ``k`` of ``E`` (in index order) goes to the rank whose block of the ``E`` experts,
  cut as ``torch.tensor_split`` cuts (the first ranks take one more), holds ``k``: its root is
  one block that rank owns whole (``Block.owner``), so the owner stores and multiplies the
  whole expert and every other rank holds a 0-row placeholder of each weight (0 bytes; the
  module structure, ``state_dict`` and the optimizer keep working) and computes the expert's
  product as a zero-width matmul: the combine stays a partial sum, all-reduced where it was.

A block stays tensor parallel, with the reason in the plan's ``experts``, when it has fewer
experts than ranks, when part of an expert's features is kept whole, or when a conversion
reads a value cut on an expert's features (only the combined partial sum may be converted).
``experts="auto"`` asks :func:`~tpcompile.passes.planner.experts.cost.expert_costs` with a
device that runs one matmul per expert (a loop does), the block's tokens and its router's
top-k as the routed rows.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import fx

from tpcompile.core.placement import Block, Partial, RootSpec, Shard, Specs
from tpcompile.core.plan import ShardingPlan
from tpcompile.passes.planner.dims import hinted_shape, val
from tpcompile.passes.planner.devices import device_for
from tpcompile.passes.planner.experts.cost import expert_costs

__all__ = ["whole_looped_experts"]

_EXPERT = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")


def whole_looped_experts(gm: fx.GraphModule, state, plan: ShardingPlan) -> ShardingPlan:
    """``plan`` with the looped experts of every block handed whole to ranks when
    ``plan.options.experts`` asks (and, for ``"auto"``, the cost model agrees), or left tensor
    parallel with the reason in ``plan.experts``."""
    if plan.options.experts == "tensor":
        return plan
    nodes = {n.name: n for n in gm.graph.nodes}
    roots, params, experts = dict(plan.roots), dict(plan.params), dict(plan.experts)
    for container, members in _looped_blocks(nodes, plan).items():
        module = container.rpartition(".")[0]
        why = _refusal(plan, members)
        if why is None and plan.options.experts == "auto":
            why = _auto(plan, nodes, module, members)
        if why is not None and not why.startswith("auto: expert"):
            experts[module] = f"tensor parallel: {why}"
            continue
        owners = dict(zip(sorted(members), _owners(len(members), plan.world_size)))
        for index, expert_roots in members.items():
            for root in expert_roots:
                spec = roots[root]
                roots[root] = RootSpec(root, spec.size, plan.world_size,
                                       (Block(0, spec.size, spec.size, False, owners[index]),))
        specs = Specs(plan.world_size, roots)
        for name, e in plan.params.items():
            root = e.placement.layout.root if isinstance(e.placement, Shard) else None
            index = next((i for i, rs in members.items() if root in rs), None)
            if index is None:
                continue
            dim, layout = e.placement.dim, e.placement.layout
            local = tuple(tuple(specs.local_size(layout, r) if d == dim else n
                                for d, n in enumerate(e.global_shape))
                          for r in range(plan.world_size))
            params[name] = replace(e, style="expert", local_shapes=local,
                                   reason=f"expert {index} of {container}: whole on rank "
                                          f"{owners[index]}")
        held = {r: [i for i in sorted(members) if owners[i] == r] for r in range(plan.world_size)}
        ranks = "; ".join(f"rank {r}: experts {', '.join(map(str, held[r]))}"
                          for r in range(plan.world_size))
        experts[module] = (f"expert parallel: whole experts per rank ({ranks}); "
                           + (why or f'experts="{plan.options.experts}"'))
    return replace(plan, roots=roots, params=params, experts=experts)


def _looped_blocks(nodes: dict, plan: ShardingPlan) -> dict[str, dict[int, set[str]]]:
    """``ModuleList`` path -> expert index -> the column roots of that expert, for every list
    of at least two experts whose partial sums reach one reduction."""
    by_root: dict[str, set[str]] = {}
    for e in plan.params.values():
        if isinstance(e.placement, Shard) and e.placement.layout.root in plan.roots:
            by_root.setdefault(e.placement.layout.root, set()).add(e.name)
    reduced = {c.value for c in plan.conversions if isinstance(c.src, Partial)}
    groups: dict[tuple, dict[int, set[str]]] = {}
    for root, names in by_root.items():
        match = _EXPERT.match(_listed_module(names))
        reached = _reductions(nodes, plan, names, reduced) if match else frozenset()
        if match and reached:
            group = groups.setdefault((match["container"], reached), {})
            group.setdefault(int(match["index"]), set()).add(root)
    return {container: members for (container, _), members in groups.items()
            if len(members) >= 2}


def _listed_module(names: set[str]) -> str:
    """The innermost module every parameter in ``names`` lives under that is an item of a
    list (its path ends in an index), or ''."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    while common and not common[-1].isdigit():
        common.pop()
    return ".".join(common)


def _reductions(nodes: dict, plan: ShardingPlan, names: set[str], reduced: set) -> frozenset:
    """The partial sums converted downstream of the weights ``names`` (followed through every
    value cut on their root or summed partially)."""
    seen, found = set(), set()
    todo = [n for n in nodes.values() if n.op == "get_attr" and n.target in names]
    while todo:
        node = todo.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        if node.name in reduced:
            found.add(node.name)
        for user in node.users:
            p = plan.placement(user.name)
            if isinstance(p, (Shard, Partial)):
                todo.append(user)
    return frozenset(found)


def _refusal(plan: ShardingPlan, members: dict[int, set[str]]) -> str | None:
    """Why a block's experts cannot be handed whole to ranks, or None."""
    if len(members) < plan.world_size:
        return f"{len(members)} experts: fewer than the {plan.world_size} ranks"
    roots = set().union(*members.values())
    for root in sorted(roots):
        if any(b.replicated for b in plan.roots[root].blocks):
            return f"part of {root}'s features is kept whole"
    for c in plan.conversions:
        if any(isinstance(p, Shard) and p.layout.root in roots for p in (c.src, c.dst)):
            return f"{c.user} reads {c.value} converted ({c.kind})"
    return None


def _owners(count: int, ranks: int) -> list[int]:
    """The rank of each of ``count`` experts: contiguous blocks, the first ranks one more."""
    q, extra = divmod(count, ranks)
    return [r for r in range(ranks) for _ in range(q + (r < extra))]


def _auto(plan: ShardingPlan, nodes: dict, module: str, members: dict[int, set[str]]) -> str:
    """``"auto: <cut>: <costs>"``: the cheaper cut of the block by the cost model, for its
    expert count, each expert's width (its column root) and model width (its first weight's
    other dim), and the block's tokens times its router's top-k as the routed rows."""
    first = members[min(members)]
    weight = next(e for e in plan.params.values() if isinstance(e.placement, Shard)
                  and e.placement.layout.root in first and e.placement.dim == 0)
    width, model_width = weight.global_shape[:2]
    tokens, top_k = _tokens_and_top_k(nodes, plan, module, model_width)
    stored = next(n for n in nodes.values() if n.op == "get_attr" and n.target == weight.name)
    device = replace(device_for(val(stored).device.type), call_per_expert=True)  # a loop
    costs = expert_costs(len(members), width, model_width, tokens * top_k, plan.world_size,
                         device, tokens=tokens)
    pick = min(costs, key=lambda m: costs[m].seconds)
    return f"auto: {pick}: cost model ({costs['tensor']}; {costs['expert']})"


def _tokens_and_top_k(nodes: dict, plan: ShardingPlan, module: str, width: int):
    """The block's tokens (its reduced sum's elements / the model width) and its router's
    ``topk`` k (1 if it has none)."""
    reduced = {c.value for c in plan.conversions if isinstance(c.src, Partial)}
    tokens, top_k = 1, 1
    for node in nodes.values():
        stack = node.meta.get("nn_module_stack")
        path = list(stack.values())[-1][0] if stack else ""
        if not (path == module or path.startswith(module + ".")):
            continue
        if node.target is torch.ops.aten.topk.default:
            top_k = int(node.args[1])
        if node.name in reduced:
            tokens = max(tokens, _numel(node) // width)
    return tokens, top_k


def _numel(node: fx.Node) -> int:
    n = 1
    for s in hinted_shape(node):
        n *= int(s)
    return n
