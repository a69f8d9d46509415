"""The planner: propagate placements, refine, and freeze the result into a ShardingPlan.

``plan_sharding`` repeats :func:`propagate` until nothing changes:

1. *Demands*: a view that splits features into ``(heads, head_dim)``, a split of a fused qkv
   output, or grouped-query heads meeting their query groups each say how a root must be cut
   (whole heads, per-chunk blocks, whole groups). They are added and propagation reruns.
2. *Regions*: roots that meet in one op (q and k in an attention, w1 and w3 in SwiGLU) form a
   region. A region must end where sharded data turns into a partial sum or a replicated
   result by itself (a row-parallel matmul, a vocabulary-parallel loss or embedding). A
   region that never does, or that leaks sharded data into ops needing whole rows (a norm over
   features, a gathered graph output), is killed: its roots stay replicated, propagation reruns.
   An in-place write (slice assignment) into sharded data that would land on a copy keeps
   that data's roots replicated too (see :mod:`tpcompile.passes.planner.mutations`). So does
   a partial sum reduced only to join another region's shards (a LoRA adapter's ``A -> B``
   beside a column-parallel base): kept whole, its row-parallel matmul goes column-parallel
   cut like those shards (:mod:`tpcompile.passes.planner.joins`).
3. *Tied tables*: a weight sharded by a column-parallel LM head that an embedding also reads
   makes that embedding vocabulary-parallel too, so the table is sharded once. *Early
   reductions*: a partial sum that one consumer all-reduces is read reduced by all of them.
4. *Reductions in pieces*: a partial sum split, sliced or cast into pieces that are reduced
   one by one is reduced once where it is made.
5. *Carried sums*: a tree of sums adding several row-parallel outputs and a replicated
   residual (``x + attn(h) + mlp(h)``) reads the residual as rank 0's share of the partial
   sum, so the tree is reduced once, not once per partial sum
   (:mod:`tpcompile.passes.planner.carried_sums`).

Refinements that change propagation (1, 3) are settled before regions are judged (2), since
a killed root stays killed; 4 merges reductions only of regions that stand as written, and 5
carries sums only once the rest has settled.

Then :mod:`tpcompile.passes.planner.freeze` reads the settled state into the plan:
parameters whose every use wants the same shard are sharded themselves (instead of being
sliced at each use), and replicated values whose gradient arrives as per-rank partial sums are
marked for a gradient all-reduce (Megatron's *f*), one per value however many consumers
(:mod:`tpcompile.passes.planner.grad_syncs`).
"""

from __future__ import annotations

import functools
import logging

import networkx as nx
from torch import fx

from tpcompile.core.capture import Capture, origin
from tpcompile.errors import TPCompileError
from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.core.plan import PlanOptions, ShardingPlan
from tpcompile.passes.planner.rules import cache_behind, is_lookup
from tpcompile.passes.planner.grad_syncs import (
    grad_syncs, is_distributed, values_with_grad, whole_grads_into_chunks, whole_roots,
)
from tpcompile.passes.planner.carried_sums import carried_sums
from tpcompile.passes.planner.freeze import consumed, freeze, pulled_back
from tpcompile.passes.planner.grouped_experts import whole_grouped_experts
from tpcompile.passes.planner.looped_experts import whole_looped_experts
from tpcompile.passes.planner.joins import partials_joining_shards, roots_behind
from tpcompile.passes.planner.mutations import check_mutations, write_conflicts, written_args
from tpcompile.passes.planner.propagate import (
    SEQUENCE, Constraints, Propagation, _same, local_slice, propagate, view_chain,
)

log = logging.getLogger(__name__)

__all__ = ["plan_sharding"]

MAX_ROUNDS = 64


def plan_sharding(cap: Capture, world_size: int,
                  options: PlanOptions = PlanOptions()) -> tuple[ShardingPlan, dict[fx.Node, str]]:
    """Choose column / row / vocabulary / replicated placements for every weight of ``cap.gm``.

    Returns the plan, and the ops with no rule that met a sharded or partial input in any
    round, with why (the pipeline decomposes them and plans again).
    """
    if world_size < 1:
        raise TPCompileError(f"world_size must be >= 1, got {world_size}")
    gm = cap.gm
    constraints = Constraints(cap.params, options, seq_len=_sequence_length(cap, options))
    needs_grad = values_with_grad(gm, cap.trainable)
    no_rule: dict[fx.Node, str] = {}
    for _ in range(MAX_ROUNDS):
        state = propagate(gm, world_size, constraints)
        no_rule.update(state.no_rule)
        fresh = [d for d in state.demands if d not in constraints.demands]
        if fresh:
            constraints.demands.extend(fresh)
            continue
        tied = _tables_to_follow(gm, state) - constraints.tied
        early = _mixed_partials(state) - constraints.reduce_early
        cuts = {k: v for k, v in _cache_cuts(state, cap.params).items()
                if k not in constraints.cache_cuts}
        if tied or early or cuts:
            constraints.tied |= tied
            constraints.reduce_early |= early
            constraints.cache_cuts.update(cuts)
            continue
        dead = _dead_regions(state, options)
        whole = whole_roots(gm, state)
        dead.update((r, why) for r, why in _written_copies(gm, state, cap.params, needs_grad,
                                                           whole).items() if r not in dead)
        dead.update((r, why) for r, why in _stale_ties(state, constraints).items() if r not in dead)
        dead.update((r, why) for r, why in whole_grads_into_chunks(gm, state, needs_grad,
                                                                   whole).items() if r not in dead)
        if dead:
            constraints.killed.update(dead)
            continue
        # judged once every region stands: a shard joined in a region that is about to be
        # killed is no reason to keep a side chain whole
        joins = partials_joining_shards(state)
        if joins:
            constraints.killed.update(joins)
            continue
        # regions are judged on the reductions their code pays; the ones that stand then
        # reduce each partial sum once rather than in pieces
        pieces = _partials_reduced_in_pieces(state, constraints.carried) - constraints.reduce_early
        if pieces:
            constraints.reduce_early |= pieces
            continue
        # last, on the plan as it stands: sums of row-parallel outputs and a residual carried
        # partial, reduced once
        carried, tops = carried_sums(gm, state, options.sequence_parallel, constraints.carried)
        carried -= constraints.carried
        tops -= constraints.reduce_early
        if not carried and not tops:
            break
        constraints.carried |= carried
        constraints.reduce_early |= tops  # each tree reduced once, where it ends
    else:
        log.warning("tpcompile: planner did not settle after %d rounds", MAX_ROUNDS)
    plan = whole_grouped_experts(gm, freeze(cap, state, constraints, world_size, needs_grad),
                                 state.experts)
    plan = whole_looped_experts(gm, plan)
    check_mutations(gm, plan)  # an in-place write must not land on a copy others still read
    no_rule.update(state.no_rule)  # freeze's trial cuts of quantized weights add theirs
    return plan, no_rule


def _sequence_length(cap: Capture, options: PlanOptions) -> int | None:
    """Dim 1 of the first input with one: what sequence parallelism cuts."""
    if not options.sequence_parallel:
        return None
    for shape_, _ in cap.input_specs:
        if len(shape_) >= 2:
            return int(shape_[1])
    raise TPCompileError("sequence_parallel needs an input with a sequence dim (dim 1), "
                         f"got input shapes {[s for s, _ in cap.input_specs]}")


def _dead_regions(state: Propagation, options: PlanOptions) -> dict[str, str]:
    """Roots of regions with no proper exit, or that leak sharded data: root -> why."""
    regions = nx.Graph()
    regions.add_nodes_from(state.roots)
    regions.add_edges_from((a, b) for a, b in state.links if a in state.roots and b in state.roots)
    exits, leaks, ends = set(), {}, {}
    for node, placement in state.placements.items():
        if placement is None or isinstance(placement, (Shard, list, tuple)):
            continue
        for arg in node.all_input_nodes:  # sharded in, partial or replicated out: an exit
            p = consumed(state, arg, node)
            if isinstance(p, Shard):
                exits.add(p.layout.root)
    for (value, user), dst in state.conversions.items():
        src = state.placements.get(value)
        if not isinstance(src, Shard) or local_slice(state.specs, src, dst):
            continue  # a re-shard that is no local slice gathers, like a conversion to R
        refused = (f"{user.name} ({origin(user)}) reads {value.name} {src} as {dst}"
                   if user.op != "output" else f"the model's output {value.name} is {src} "
                   "(outputs are whole; loss_parallel=True keeps logits sharded)")
        if user.name in state.fallbacks:  # an op with no rule: where the region ends
            ends.setdefault(src.layout.root, f"{user.name} ({origin(user)}): "
                                             f"{state.fallbacks[user.name]}")
        else:
            # a rule that needs the whole dim (a norm over features, the graph output): the
            # region leaks into replicated code and would gather there on every step
            leaks.setdefault(src.layout.root, refused)
    if options.loss_parallel:  # sharded logits handed to the user are an exit too
        exits |= {p.layout.root for a in state.output.all_input_nodes
                  if isinstance(p := consumed(state, a, state.output), Shard)}
    reductions = _reductions_by_root(state)
    dead = {}
    for component in nx.connected_components(regions):
        leak = next((leaks[r] for r in sorted(component) if r in leaks), None)
        costly = _statistics_beyond_one_chain(component, reductions) if leak is None else None
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
    return dead


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


def _statistic(state: Propagation, node: fx.Node) -> bool:
    """A partial sum that is a per-token statistic, or computed from statistics alone."""
    if node in state.statistics:
        return True
    inputs = [a for a in node.all_input_nodes if is_distributed(state.placements.get(a))]
    return (isinstance(state.placements.get(node), Partial) and bool(inputs)
            and all(_statistic(state, a) for a in inputs))


def _statistics_beyond_one_chain(component, reductions) -> str | None:
    """Why a region that all-reduces per-token statistics (a norm over its sharded features)
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
        [f"reduce-scatter {', '.join(sorted(onward))} into another region's shards"] if onward else [])
    return (f"{' and '.join(costs)} besides the per-token statistics of {', '.join(sorted(stats))}"
            ": a norm over sharded features is worth its statistic's all-reduce only inside one "
            "chain (one partial sum, reduced whole)")


def _written_copies(gm: fx.GraphModule, state: Propagation, params, needs_grad: set,
                    whole: frozenset[str]) -> dict[str, str]:
    """Roots whose sharded data an in-place op would write on a copy of: root -> why.

    The copy is a conversion, or the gradient sync (Megatron's *f*) through which a sharded
    region reads a replicated value: then the region's roots are the ones that make it.
    Keeping them replicated makes the write land where the unsharded model's does.
    """
    @functools.cache
    def syncs() -> dict:  # only models with in-place writes ask
        return grad_syncs(gm, state, needs_grad, whole)

    def copied(value, user) -> bool:
        if (value, user) in state.conversions:
            return not _cache_slice(value, user, state, params)
        return value.name in syncs()

    out = {}
    conflicts = write_conflicts(gm, copied)
    nodes = {n.name: n for n in gm.graph.nodes} if conflicts else {}
    for c in conflicts:
        value = c.edge[0]
        readers = _sharded_readers(state, [nodes[u] for u in syncs().get(value.name, ())])
        for node in [value] + c.chain + readers:
            for root in roots_behind(state, node, set()):
                out.setdefault(root, f"{c.op.name} ({c.op.target}) writes into its sharded data "
                                     "in place; sharded, the write would land on a copy")
    return out


def _sharded_readers(state: Propagation, nodes: list[fx.Node]) -> list[fx.Node]:
    """The first distributed values downstream of ``nodes`` through replicated ones: where a
    synced value's gradient becomes partial (the sync may sit above them, at a fork)."""
    out, todo, seen = [], list(nodes), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(state.placements.get(node), Replicate):
            todo.extend(node.users)
        else:
            out.append(node)
    return out


def _cache_slice(value: fx.Node, user: fx.Node, state: Propagation, params) -> bool:
    """A write into a KV-cache buffer that asks for its shard: ``freeze`` stores the
    buffer sharded, so the write lands in each rank's own shard, not on a copy."""
    return (value in written_args(user) and isinstance(state.placements.get(value), Replicate)
            and isinstance(state.conversions[(value, user)], Shard)
            and cache_behind(value, params) is not None)


def _cache_cuts(state: Propagation, params) -> dict[str, Shard]:
    """Replicated cache writes whose readers all slice the same shard of the cache (fewer kv
    heads than ranks: each rank reads its query heads' kv heads): write node -> that shard,
    so the rule stores only it (``_cut_cache`` in the rule table)."""
    out = {}
    for node, p in state.placements.items():
        written = written_args(node)
        if (not isinstance(p, Replicate) or not written
                or cache_behind(written[0], params) is None):
            continue
        chain = view_chain(node)
        wanted = [state.conversions.get((chain[-1], u)) for u in chain[-1].users]
        if wanted and all(isinstance(w, Shard) and _same(state.specs, wanted[0], w) for w in wanted):
            placements = pulled_back(chain, wanted[0], state.specs)
            if placements is not None:
                out[node.name] = placements[0]
    return out


def _mixed_partials(state: Propagation) -> set[str]:
    """Partial sums some consumer reduces while others carry them on partially.

    Once the all-reduce is paid for one consumer, every consumer should read its result;
    carrying the partial sum further (through the norm's ``x * rsqrt(...)`` into q/k/v, say)
    would only need more all-reduces later.
    """
    out = set()
    for node, p in state.placements.items():
        if not isinstance(p, Partial):
            continue
        reads = [consumed(state, node, u) for u in node.users]
        if any(isinstance(r, Replicate) for r in reads) and any(isinstance(r, Partial) for r in reads):
            out.add(node.name)
    return out


def _partials_reduced_in_pieces(state: Propagation, carried: set[str]) -> set[str]:
    """Partial sums that ops linear in them carry on (splits, slices, matmuls, casts) until
    several consumers each reduce their own piece (all-reduce or reduce-scatter).

    A partial sum read by a carried sum (``carried``) is a summand of that sum's tree, reduced
    with it once, not a piece of its own: a block's carried residual, reduced for the next
    block's norm and also added into the next block's sum, is reduced once where it is made.

    Mamba's ``x_proj`` output is split into dt, B and C; C is sliced once per time step, and dt
    runs through ``dt_proj`` before it meets the channel shards: one all-reduce where the sum
    is made serves every piece (and lets ``dt_proj`` be column-parallel), instead of one
    collective per piece.
    """
    below: dict[fx.Node, frozenset | None] = {}

    def reductions(node: fx.Node) -> frozenset | None:
        """The reductions of ``node``'s partial sum downstream, as (value, placement read)
        pairs: a sum carried along several paths that meet again (litgpt's accumulator,
        gathered from and written into by each expert) is reduced once where they meet.
        None if a piece leaves otherwise."""
        if node not in below:
            found: set | None = set()
            for user in node.users:
                read = consumed(state, node, user)
                if isinstance(read, (Replicate, Shard)):
                    found.add((node, read))  # consumers reading one placement share one
                    continue
                if _partial(read) and not _partial(state.placements.get(user)):
                    continue  # not read as data: a metadata check, type_as's dtype operand
                if _partial(read) and user.name in carried:
                    continue  # a summand of a carried tree, reduced with it
                more = reductions(user) if _partial(read) else None
                if more is None:
                    found = None
                    break
                found |= more
            below[node] = None if found is None else frozenset(found)
        return below[node]

    def reduced_in_pieces(node: fx.Node) -> bool:
        return _partial(state.placements.get(node)) and len(reductions(node) or ()) >= 2

    return {n.name for n, p in state.placements.items() if isinstance(p, Partial) and reduced_in_pieces(n)
            and not any(reduced_in_pieces(a) for a in n.all_input_nodes)}


def _partial(p) -> bool:
    """A partial sum, or a multi-output op's list of them (a split of one)."""
    if isinstance(p, (list, tuple)):
        return bool(p) and all(_partial(x) for x in p)
    return isinstance(p, Partial)


def _tables_to_follow(gm: fx.GraphModule, state: Propagation) -> set[str]:
    """Roots whose weight an embedding still reads whole: that embedding should shard it too."""
    out = set()
    for root in state.roots:
        w = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == root), None)
        for user in (w.users if w is not None else ()):
            if is_lookup(user) and not isinstance(
                    consumed(state, w, user), Shard):
                out.add(root)
    return out


def _stale_ties(state: Propagation, constraints) -> dict[str, str]:
    """Tied tables whose matmul no longer shards them (its region refused for another reason):
    a vocabulary-parallel lookup alone would follow a cut no matmul makes."""
    return {root: "its tied table's matmul keeps it whole" for root in constraints.tied
            if root in state.roots and all(is_lookup(u) for u in state.root_users.get(root, ()))}
