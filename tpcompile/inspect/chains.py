"""Chains: the column -> row parallel runs of a plan, recovered from the graph.

The plan records placements per node and a root (a column-parallel weight's output features)
per shard layout, but not which roots work together: q, k and v of one attention are three
roots that meet in SDPA and leave through one row-parallel ``wo``. Explaining a plan ("wq is
colwise *because* it feeds wo") and mapping it to PyTorch's per-module styles both need those
groups, so they are rebuilt here: roots that appear together in one node's inputs or output
belong to one chain. This is an analysis of a finished plan; it changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from torch import fx

from tpcompile.core.block_paths import block_path
from tpcompile.core.capture import module_path
from tpcompile.core.placement import Partial, Shard, each
from tpcompile.core.plan import ShardingPlan
from tpcompile.passes.planner.propagate import SEQUENCE, view_chain
from tpcompile.passes.planner.rules.quantized import dequantized_readers, dequantized_weight
from tpcompile.passes.planner.rules import is_param_matmul, is_sum

__all__ = ["Chain", "find_chains"]


@dataclass(frozen=True)
class Chain:
    name: str                   # the modules' common path, e.g. "layers.0.attention"
    layer: str                  # the repeated block it sits in, e.g. "layers.0" ("" if none)
    colwise: tuple[str, ...]    # sharded parameters by style (aliases not repeated)
    rowwise: tuple[str, ...]
    replicated_blocks: tuple[str, ...]  # weights replicated inside the chain (few KV heads)
    entries: tuple[str, ...]    # replicated activations entering its column-parallel matmuls
    exits: tuple[str, ...]      # its row-parallel matmuls (their outputs are partial sums)
    nodes: frozenset[str]       # every node that reads or produces this chain's shards
    synced: tuple[str, ...]     # replicated values used in it whose gradients are all-reduced
    experts: tuple[str, ...] = ()  # stacked expert weights cut by whole experts

    def describe(self) -> str:
        """'wq, wk, wv -> wo'; 'wq (wk, wv replicated) -> wo' with replicated KV blocks."""
        def short(names):
            return ", ".join(n.removeprefix(self.name + ".").removesuffix(".weight")
                             for n in names if not n.endswith(".bias"))
        head = short(self.colwise)
        if self.experts:
            head = ", ".join(filter(None, (head, f"{short(self.experts)} by whole experts")))
        if self.replicated_blocks:
            head += f" ({short(self.replicated_blocks)} replicated)"
        return f"{head} -> {short(self.rowwise)}" if self.rowwise else head


def _roots(p) -> set[str]:
    """The column-parallel roots a placement is cut from; sequence shards (SP) join no chain:
    the residual stream between chains is cut by position, not by any weight."""
    return {x.layout.root for x in each(p) if isinstance(x, Shard) and x.layout.root != SEQUENCE}


def _common_path(paths: list[str]) -> str:
    split = [p.split(".") for p in paths]
    common = os.path.commonprefix(split) if split else []
    return ".".join(common)


def find_chains(gm: fx.GraphModule, plan: ShardingPlan) -> tuple[list[Chain], dict[str, str]]:
    """The plan's chains and, for every node in one, the chain's name.

    ``gm`` is the planned graph before the rewrite passes (node names match the plan's).
    """
    consumed = plan.converted
    parent: dict[str, str] = {}

    def find(r: str) -> str:
        while parent.setdefault(r, r) != r:
            r = parent[r]
        return r

    node_roots: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        out = plan.placements.get(node.name)
        roots, summed = _roots(out), set()
        layer = block_path(module_path(node))
        for arg in node.all_input_nodes:
            elsewhere = layer and block_path(module_path(arg)) != layer
            if isinstance(out, Partial) and not is_sum(node):
                roots |= node_roots.get(arg.name, set())  # partial sums carry their chain
            elif isinstance(out, Partial) and not elsewhere:
                # a sum of partial sums (a parallel block's attention and MLP) ends each of
                # its chains and joins none of them to another; one made in the block before
                # (a carried residual) is not this block's
                summed |= node_roots.get(arg.name, set())
            if elsewhere:
                # a shard made outside this layer and read in several (CPM-Ant's relative
                # position bias, cut by heads): linking through it would make all one chain
                continue
            roots |= _roots(plan.placements.get(arg.name))
            roots |= _roots(consumed.get((arg.name, node.name)))
        for r in roots:
            parent[find(r)] = find(min(roots))
        if roots or summed:
            node_roots[node.name] = roots | summed

    members: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.name in node_roots:  # a sum of several chains' partial sums joins one of them
            members.setdefault(find(min(node_roots[node.name])), []).append(node)
    chains, chain_of = [], {}
    readers = dequantized_readers(gm)
    for group in members.values():
        chain = _build(group, plan, readers)
        taken = sum(1 for c in chains if c.name.split("#")[0] == chain.name)
        if taken:  # two chains under one module: number them
            chain = replace(chain, name=f"{chain.name}#{taken + 1}")
        chains.append(chain)
        chain_of.update((n.name, chain.name) for n in group)
    return chains, chain_of


def _sums_experts(node: fx.Node, plan: ShardingPlan) -> bool:
    """``node`` sums over experts cut whole per rank: its output is a partial sum made from a
    shard (the expert-parallel chain's exit, where a row-parallel matmul would be)."""
    if not isinstance(plan.placements.get(node.name), Partial):
        return False
    expert_roots = {e.placement.layout.root for e in plan.params.values() if e.style == "expert"}
    return any(isinstance(p, Shard) and p.layout.root in expert_roots
               for a in node.all_input_nodes
               for p in [plan.converted.get((a.name, node.name), plan.placements.get(a.name))])


def _build(nodes: list[fx.Node], plan: ShardingPlan, readers: dict[fx.Node, fx.Node]) -> Chain:
    """``readers``: the matmul each quantized weight (and its scales) is dequantized for."""
    by_style: dict[str, list[str]] = {"colwise": [], "rowwise": [], "expert": [], "replicate": []}
    entries, exits = [], []
    for node in nodes:
        entry = plan.params.get(node.target) if node.op == "get_attr" else None
        if entry is not None and isinstance(entry.placement, Shard):
            fqn = entry.aliases[0]
            by_style.setdefault(entry.style, []).append(fqn)
            weight = view_chain(node)[-1]  # the weight as its matmul reads it (w.t(), w.T, w)
            for user in ([readers[node]] if node in readers else weight.users):
                if entry.style == "rowwise" and user.name not in exits:
                    exits.append(user.name)
                if entry.style == "colwise" and is_param_matmul(user):
                    entries.extend(a.name for a in user.all_input_nodes  # the activations
                                   if a is not weight and a.op != "get_attr" and a.name not in entries
                                   and dequantized_weight(a) is None)
                if entry.style == "expert" and is_param_matmul(user):
                    entries.extend(a.name for a in user.all_input_nodes  # replicated tokens
                                   if a is not weight and a.name not in entries
                                   and not _roots(plan.placements.get(a.name)))
    exits += [n.name for n in nodes if _sums_experts(n, plan)]
    params = by_style["colwise"] + by_style["rowwise"] + by_style["expert"] + by_style["replicate"]
    owners = [p.rpartition(".")[0] for p in params] or [nodes[0].name]
    inside = [o for o in owners if block_path(o)]  # a table outside the blocks joins their chain
    name = _common_path(inside or owners) or owners[0]
    members = frozenset(n.name for n in nodes)
    synced = tuple(v.name for v in {a for n in nodes for a in n.all_input_nodes}
                   if v.name in plan.grad_syncs)
    return Chain(name, block_path(name), tuple(by_style["colwise"]), tuple(by_style["rowwise"]),
                 tuple(by_style["replicate"]), tuple(entries), tuple(exits), members,
                 tuple(sorted(synced)), tuple(by_style["expert"]))
