"""Dead chains: roots that meet in one op form a chain, kept whole unless it ends properly.

Roots that meet in one op (q and k in an attention, w1 and w3 in SwiGLU) form a chain. A
chain must end where sharded data turns into a partial sum or a replicated result by itself
(a row-parallel matmul, a vocabulary-parallel loss or embedding). A chain that never does,
that leaks sharded data into ops needing whole rows (a norm over features, a gathered graph
output), that all-reduces per-token statistics beyond one chain, or whose partial sum is a
product of two activations it cuts along the summed dim (attention scores over a head's cut
features) is killed: its roots stay replicated and propagation reruns. An LM head
``vocab_parallel`` asks to cut (:func:`~tpcompile.passes.planner.rules.vocabulary.vocabulary_heads`)
ends at the model's output: its logits are all-gathered there. Roots a rule refused
(``Propagation.rejected``) are killed with them.
"""

from __future__ import annotations

import networkx as nx
from torch import fx

from tpcompile.core.capture import origin
from tpcompile.core.placement import Partial, Shard
from tpcompile.passes.planner.grad_syncs import is_distributed
from tpcompile.passes.planner.propagate import SEQUENCE, Constraints, Propagation, local_slice
from tpcompile.passes.planner.reads import consumed, roots_behind
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.rules import is_param_matmul
from tpcompile.passes.planner.rules.vocabulary import vocabulary_heads

__all__ = ["dead_chains"]


def dead_chains(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Kill the roots of chains with no proper exit, or that leak sharded data."""
    options = constraints.options
    chains = nx.Graph()
    chains.add_nodes_from(state.roots)
    chains.add_edges_from((a, b) for a, b in state.links if a in state.roots and b in state.roots)
    exits, leaks, ends = set(), {}, {}
    heads = vocabulary_heads(gm, state.specs.roots) if options.vocab_parallel else set()
    for node, placement in state.placements.items():
        if placement is None or isinstance(placement, (Shard, list, tuple)):
            continue
        for arg in node.all_input_nodes:  # sharded in, partial or replicated out: an exit
            p = consumed(state, arg, node)
            if isinstance(p, Shard):
                exits.update(state.specs.bases(p.layout.root))
    for (value, user), dst in state.conversions.items():
        src = state.placements.get(value)
        if not isinstance(src, Shard) or local_slice(state.specs, src, dst):
            continue  # a re-shard that is no local slice gathers, like a conversion to R
        refused = (f"{user.name} ({origin(user)}) reads {value.name} {src} as {dst}"
                   if user.op != "output" else f"the model's output {value.name} is {src} "
                   "(outputs are whole; loss_parallel=True keeps logits sharded)")
        for root in state.specs.bases(src.layout.root):
            if user.op == "output" and root in heads:  # the vocabulary's logits, gathered
                exits.add(root)
            elif user.name in state.fallbacks:  # an op with no rule: where the chain ends
                ends.setdefault(root, f"{user.name} ({origin(user)}): "
                                      f"{state.fallbacks[user.name]}")
            else:
                # a rule that needs the whole dim (a norm over features, the graph output):
                # the chain leaks into replicated code and would gather there on every step
                leaks.setdefault(root, refused)
    if options.loss_parallel:  # sharded logits handed to the user are an exit too
        exits |= {r for a in state.output.all_input_nodes
                  if isinstance(p := consumed(state, a, state.output), Shard)
                  for r in state.specs.bases(p.layout.root)}
    reductions, products = _reductions_by_root(state), _cut_products(gm, state)
    dead = {}
    for component in nx.connected_components(chains):
        leak = next((leaks[r] for r in sorted(component) if r in leaks), None)
        costly = _statistics_beyond_one_chain(component, reductions) if leak is None else None
        product = next((products[r] for r in sorted(component) if r in products), None)
        if leak is None and costly is None and product is not None:
            costly = (f"make {product} a partial sum, a product of two activations it cuts "
                      "along the dim the product sums (attention scores over a head's cut "
                      "features: a T x T all-reduce per head where Megatron, cutting heads, "
                      "has none)")
        if leak is None and costly is None and component & exits:
            continue
        users = sorted({u.name for r in component for u in state.root_users.get(r, ())})
        end = next((ends[r] for r in sorted(component) if r in ends), None)
        if leak is not None:
            why = f"sharding it ({', '.join(users)}) would all-gather where {leak}"
        elif costly is not None:
            why = f"sharding it ({', '.join(users)}) would {costly}"
        elif end is not None:
            why = f"sharding it ({', '.join(users)}) would all-gather at {end}"
        else:
            why = (f"sharding it ({', '.join(users)}) never reaches a row-parallel consumer "
                   "(no op sums its sharded dim)")
        for root in component:
            dead[root] = why
    dead.update((r, why) for r, why in state.rejected.items() if r not in dead)
    return Decision(killed=dead)


def _reductions_by_root(state: Propagation) -> dict[str, tuple[set, set, set]]:
    """root -> the partial sums its sharded data is reduced as: (per-token statistics, other
    sums, sums reduce-scattered into another root's shards)."""
    out: dict[str, tuple[set, set, set]] = {}
    for (value, _), dst in state.conversions.items():
        if not isinstance(state.placements.get(value), Partial) or isinstance(dst, Partial):
            continue
        kind = 0 if _statistic(state, value) else (
            2 if isinstance(dst, Shard) and dst.layout.root != SEQUENCE else 1)
        for root in roots_behind(state, value, set()):
            out.setdefault(root, (set(), set(), set()))[kind].add(value.name)
    return out


def _cut_products(gm: fx.GraphModule, state: Propagation) -> dict[str, str]:
    """root -> a partial sum of its chain that multiplies two activations (values computed
    from the model's inputs, not a weight however dequantized), both sharded and cut along the
    dim the product sums: ``q @ k^T`` of a one-head attention whose head features the chain
    splits, reduced there or after a scaling. Not experts combined by routing weights: the
    weights are replicated, sliced to each rank's experts."""
    data, out = set(gm.graph.find_nodes(op="placeholder")), {}
    for node in gm.graph.nodes:
        if any(a in data for a in node.all_input_nodes):
            data.add(node)
    for value, placement in state.placements.items():
        if not isinstance(placement, Partial) or not is_param_matmul(value):
            continue
        cut = [a for a in value.all_input_nodes if isinstance(state.placements.get(a), Shard)
               and isinstance(consumed(state, a, value), Shard)]
        if len(cut) == 2 and all(a in data for a in cut):
            for root in roots_behind(state, value, set()):
                out.setdefault(root, value.name)
    return out


def _statistic(state: Propagation, node: fx.Node) -> bool:
    """A partial sum that is a per-token statistic, or computed from statistics alone."""
    if node in state.statistics:
        return True
    inputs = [a for a in node.all_input_nodes if is_distributed(state.placements.get(a))]
    return (isinstance(state.placements.get(node), Partial) and bool(inputs)
            and all(_statistic(state, a) for a in inputs))


def _statistics_beyond_one_chain(component, reductions) -> str | None:
    """Why a chain that all-reduces per-token statistics (a norm over its sharded features)
    is refused: it is not one Megatron chain, whose output is one partial sum reduced whole
    (or into sequence shards). A whole-projection q/k norm inside attention costs a number per
    token; the same norm over a residual stream a lone column projection sharded would cost a
    sum per layer that reads it, and MLA's low-rank q_a -> norm -> q_b would reduce-scatter
    q into heads where Megatron keeps q_a whole for free."""
    stats, sums, onward = (set().union(*(reductions[r][k] for r in component if r in reductions))
                           for k in range(3))
    if not stats or (len(sums) <= 1 and not onward):
        return None
    costs = ([f"all-reduce {len(sums)} partial sums ({', '.join(sorted(sums))})"] if sums else []) + (
        [f"reduce-scatter {', '.join(sorted(onward))} into another chain's shards"] if onward else [])
    return (f"{' and '.join(costs)} besides the per-token statistics of {', '.join(sorted(stats))}"
            ": a norm over sharded features is worth its statistic's all-reduce only inside one "
            "chain (one partial sum, reduced whole)")
