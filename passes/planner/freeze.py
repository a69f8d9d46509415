"""Freeze a settled propagation into the :class:`ShardingPlan` the rewrite follows.

The planner (:mod:`tpcompile.passes.planner.plan_sharding`) reruns propagation until nothing
changes; this module reads the result once. A weight every use wants sharded the same way is
stored sharded (``w.t()``, ``w.view(...)`` and elementwise uses carried back through the rule
table's dim maps; quantized weights through their dequantization), each parameter gets its
style and the reason for it, replicated values whose gradient arrives as per-rank partial sums
get their gradient syncs (:mod:`tpcompile.passes.planner.grad_syncs`), and every conversion
the plan's consumers need is recorded.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.core.capture import Capture
from tpcompile.core.placement import Layout, Misaligned, Partial, Replicate, Shard, Specs
from tpcompile.core.plan import Conversion, ParamPlan, ShardingPlan
from tpcompile.passes.planner.dims import shape, sub_layout, val
from tpcompile.passes.planner.experts.placement import expert_placements
from tpcompile.passes.planner.grad_syncs import grad_syncs, partial_grads, whole_roots
from tpcompile.passes.planner.propagate import (
    Constraints, Propagation, same_placement, carrier_chain, value_readers, view_chain,
    weight_chain,
)
from tpcompile.passes.planner.rules.quantized import dequantized_readers, undequantized_reason
from tpcompile.passes.planner.absorb_dequantized import absorb_dequantized
from tpcompile.passes.planner.reads import consumed
from tpcompile.passes.planner.rules import (
    is_lookup, is_param_matmul, is_view, piece_of, shard_map, weight_out_first,
)

__all__ = ["ABSORB", "freeze", "pulled_back"]


def absorb_params(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> None:
    """A weight every use wants sharded the same way is stored sharded; no slicing at use.

    A weight used through views (``w.t()``, ``w.T``, ``w.view(...)``) or elementwise ops
    (Mamba's ``-exp(A_log)``) is stored sharded on the dim they carry to the shard its use
    wants: the rule table maps each op's dims. A weight forked into several such chains
    (stacked experts picked one by one, ``w1[e].t()`` per expert in torchtitan's loop) is
    stored sharded when every chain pulls back to the same cut of it: each rank keeps its part
    of every expert.
    """
    specs = state.specs
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        chains = _forked_chains(node)
        if chains == [[node]] and _absorb_pieces(node, state):
            continue
        pulled = [_pulled_chain(state, chain) for chain in chains]
        if not pulled or any(p is None for p in pulled):
            continue
        first = pulled[0][1][0]
        if not all(p[1][0].dim == first.dim and same_placement(specs, p[1][0], first) for p in pulled):
            continue
        for chain, placements in pulled:
            for n, p in zip(chain[1:], placements[1:]):
                state.placements[n] = p
            for u in chain[-1].users:
                state.conversions.pop((chain[-1], u), None)
        state.placements[node] = first


def _forked_chains(node: fx.Node) -> list[list[fx.Node]]:
    """``node``'s carrier chain, or, when it forks into several users that each carry its shard,
    one chain per user (each starting at ``node``)."""
    chain = carrier_chain(node)
    readers = value_readers(node)
    if len(chain) > 1 or len(readers) < 2:
        return [chain]
    if not all(shard_map(u) is not None and u.args[0] is node for u in readers):
        return [chain]
    return [[node] + carrier_chain(u) for u in readers]


def _pulled_chain(state: Propagation, chain: list[fx.Node]):
    """``(chain, placements)``: ``chain`` cut at its first conversion (where its shard is
    wanted, as a vocabulary-parallel table sliced by rows for its lookup) and the placements
    along it that end in the one shard every reader of its end wants; None if there is none."""
    cut = next((i for i, n in enumerate(chain[:-1]) if (n, chain[i + 1]) in state.conversions),
               len(chain) - 1)
    chain = chain[:cut + 1]
    end = chain[-1]
    wanted = [state.conversions.get((end, u)) for u in value_readers(end)]
    first = wanted[0] if wanted else None  # none: only export's metadata checks read it
    if not (isinstance(first, Shard) and all(
            isinstance(w, Shard) and same_placement(state.specs, first, w) for w in wanted)):
        return None
    placements = pulled_back(chain, first, state.specs)
    return None if placements is None else (chain, placements)


def _absorb_pieces(param: fx.Node, state: Propagation) -> bool:
    """A parameter split into pieces that each matmul reads sharded as its part of the
    parameter's root (:func:`~tpcompile.passes.planner.rules.piece_of`: cross-attention's q
    rows and k / v rows of ``in_proj_weight``) is stored sharded as that root, and the split
    hands each piece its part (the rewrite splits the rank's rows by their local sizes).
    False, changing nothing, unless every piece is wanted so."""
    users, specs = list(param.users), state.specs
    if len(users) != 1 or not users[0].users:
        return False
    split = users[0]
    wanted = {}
    for piece in split.users:
        where = piece_of(piece)
        want = [state.conversions.get((piece, u)) for u in value_readers(piece)]
        if where is None or where[0] is not param or not want or not all(
                isinstance(w, Shard) and same_placement(specs, want[0], w) for w in want):
            return False
        wanted[piece] = (where, want[0])
    (_, dim, _, _), first = next(iter(wanted.values()))
    root = specs.roots.get(first.layout.root)
    if root is None or root.size != shape(param)[dim]:
        return False
    whole = Layout(root.name, root.size)
    if not all(w.layout.root == root.name and where[1] == w.dim == dim
               and specs.same(sub_layout(whole, where[2], where[3]), w.layout)
               for where, w in wanted.values()):
        return False
    starts = [0]
    for out in val(split):
        starts.append(starts[-1] + int(out.shape[dim]))
    state.placements[param] = Shard(dim, whole)
    state.placements[split] = [Shard(dim, sub_layout(whole, a, b))
                               for a, b in zip(starts, starts[1:])]
    for piece, (_, w) in wanted.items():
        state.placements[piece] = w
        for u in piece.users:
            state.conversions.pop((piece, u), None)
    return True


def pulled_back(chain: list[fx.Node], wanted: Shard, specs: Specs) -> list | None:
    """Placements along ``chain`` that end in ``wanted``: the first dim of the weight whose
    shard the views carry there, or None if none does."""
    for dim in range(len(shape(chain[0]))):
        placements = [Shard(dim, wanted.layout)]
        for view in chain[1:]:
            mapped = shard_map(view)(view, placements[-1])
            if mapped is None:
                break
            placements.append(mapped)
        if (len(placements) == len(chain) and _cuttable(specs, placements)
                and same_placement(specs, placements[-1], wanted)):
            return placements
    return None


def _cuttable(specs: Specs, placements: list[Shard]) -> bool:
    """Each layout can be cut as its root is (a pulled-back merge may cut through a unit)."""
    try:
        for p in placements:
            specs.ranges(p.layout)
    except Misaligned:
        return False
    return True


def _style(node: fx.Node, state: Propagation, reader: fx.Node | None = None) -> str:
    """``reader``: the matmul a quantized weight (or its scales) is dequantized for."""
    p = state.placements[node]
    if not isinstance(p, Shard) or state.specs.is_full(p.layout):
        return "replicate"
    users = [reader] if reader is not None else _readers(node)
    if p.dim == 0 and any(is_lookup(u) for u in users):  # a table cut by rows
        return "vocab"
    if state.experts.get(p.layout.root, ("",))[0] == "expert":  # cut by whole experts
        return "expert"
    if any(isinstance(state.placements.get(u), Partial) for u in users):
        return "rowwise"
    return "colwise"


def _readers(node: fx.Node) -> list[fx.Node]:
    """The ops reading a weight's values past its views and the ops carrying its cut whole (a
    cast: ``w.bfloat16()``), through every branch where it forks into views (stacked experts
    picked one by one). Export's metadata checks read no value."""
    end = weight_chain(node)[-1]
    if end is node and len(node.users) > 1 and all(is_view(u) for u in node.users):
        return [r for u in node.users for r in view_chain(u)[-1].users]
    return value_readers(end)


def _local_shape(global_shape, placement, specs: Specs, rank: int):
    s = list(global_shape)
    if isinstance(placement, Shard):
        s[placement.dim] = specs.local_size(placement.layout, rank)
    return tuple(s)


def _replicated_reason(node: fx.Node, state: Propagation, killed: dict[str, str], cap: Capture,
                       ws: int) -> str:
    users = value_readers(node)
    if node.target in cap.subclass_parts and node.target not in cap.params:
        return killed.get(node.target) or _scales_a_sum(node, state) or undequantized_reason(node)
    if node.target not in cap.params:
        return "buffer"
    if node.target in killed:
        return killed[node.target]
    if len(users) > 1:
        return f"shared by {len(users)} ops ({', '.join(u.name for u in users)})"
    user = users[0] if users else None
    if user is not None and weight_out_first(user) and shape(node)[0] < ws:
        return f"{shape(node)[0]} output features: fewer than the {ws} ranks, nothing to split"
    partial = user is not None and isinstance(state.placements.get(user), Partial)
    if partial and is_param_matmul(user):
        return (f"{user.name} reads a partial sum: each rank applies the whole weight to its "
                "part, before the one all-reduce")
    if user is not None and is_param_matmul(user):
        return "its matmul's input is not sharded on a dim it can split"
    return "not a matmul weight (norms, embeddings and biases of replicated ops stay whole)"


def _scales_a_sum(node: fx.Node, state: Propagation) -> str | None:
    """Why a part of a subclass weight that scales a partial sum (the per-output-row scales
    of a row-parallel integer matmul) is whole; None if it scales none."""
    reader = next(iter(_readers(node)), None)
    if reader is None or not isinstance(state.placements.get(reader), Partial):
        return None
    return (f"scales {reader.name}'s partial sum, one scale per output feature: a row-parallel "
            "matmul's output features are whole on every rank")


def _whole_dequantized(reader: fx.Node, state: Propagation, cut: list[str]) -> str:
    """Why a quantized weight (or its scales) read by the matmul ``reader`` is stored whole;
    ``cut``: the tensors of the same dequantization that are stored sharded."""
    if isinstance(state.placements.get(reader), Replicate):
        return f"quantized weight of {reader.name}, which runs replicated"
    if cut:
        return (f"dequantizes {', '.join(cut)} for {reader.name}: every rank's part of it reads "
                "all of this tensor (one group's scale and zero)")
    return (f"quantized weight of {reader.name}: no cut of the stored tensors dequantizes to the "
            "shard it reads (a rank's share would split a group), so it is sliced at its use")


# what freeze stores sharded before it reads the state, in order: each
# ``name(gm, state, constraints)`` turns slices at use into parameters stored sharded
ABSORB = (absorb_params, absorb_dequantized)


def freeze(cap: Capture, state: Propagation, constraints: Constraints) -> ShardingPlan:
    """The plan of a settled ``state``, after every step of :data:`ABSORB`."""
    gm = cap.gm
    specs, ws, needs_grad = state.specs, state.specs.world_size, constraints.needs_grad
    for absorb in ABSORB:
        absorb(gm, state, constraints)
    dequantized_by = dequantized_readers(gm)
    whole = whole_roots(gm, state)
    syncs = grad_syncs(gm, state, needs_grad, whole)
    params = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users or not isinstance(val(node), torch.Tensor):
            continue  # an unused get_attr is a tied alias export keeps: the used one speaks for it
        p = state.placements[node]
        reader = dequantized_by.get(node)
        style = _style(node, state, reader)
        overlapping = isinstance(p, Shard) and specs.overlaps(p.layout)
        pieces = overlapping and p.layout.root not in whole  # a whole root's gradient is whole
        grad_sync = node.target in cap.trainable and (node.name in syncs or pieces)
        if style == "replicate" and isinstance(p, Shard):
            reason = (f"too few heads to split over {ws} ranks: replicated inside the sharded "
                      f"chain of {next(iter(node.users)).name}")
        elif style == "replicate" and reader is not None:
            cut = [n.target for n, r in dequantized_by.items()
                   if r is reader and isinstance(state.placements.get(n), Shard)]
            reason = constraints.killed.get(node.target) or _whole_dequantized(reader, state, cut)
        elif style == "replicate":
            reason = _replicated_reason(node, state, constraints.killed, cap, ws)
        else:
            user = reader or next(iter(node.users))
            reason = f"{style} in {user.name}" + (
                "; replicated blocks (too few heads for every rank)" if overlapping else "")
        gshape = tuple(int(s) for s in shape(node))
        params[node.target] = ParamPlan(
            name=node.target, aliases=cap.aliases.get(node.target, (node.target,)), style=style,
            placement=p, global_shape=gshape,
            local_shapes=tuple(_local_shape(gshape, p, specs, r) for r in range(ws)),
            grad_sync=grad_sync, reason=reason)
    conversions = tuple(
        Conversion(value.name, user.name, state.placements.get(value), dst,
                   sum_grads=value in needs_grad and partial_grads(state, value, user, dst))
        for (value, user), dst in state.conversions.items())
    used_roots = {p.layout.root for p in _all_shards(state.placements.values())}
    outputs = tuple(consumed(state, a, state.output) for a in state.output.all_input_nodes)
    return ShardingPlan(
        world_size=ws, params=params,
        placements={n.name: p for n, p in state.placements.items() if p is not None},
        conversions=conversions,
        grad_syncs=syncs,
        roots={k: v for k, v in specs.roots.items() if k in used_roots},
        fallbacks=dict(state.fallbacks),
        replicated=_kept_whole(constraints.killed, params),
        options=constraints.options,
        outputs=outputs,
        notes=cap.notes,
        inference_only=cap.inference_only,
        experts=expert_placements(state.experts, params),
    )


def _kept_whole(killed: dict[str, str], params: dict) -> dict[str, str]:
    """The weights refused as a column root that stay whole: a weight refused in one role may
    still be cut in another (an MMDiT stream's ``fc2``, refused as the root of the residual
    stream's chain, is the row-parallel end of its MLP's chain), and the plan must not say
    it is kept replicated while its table entry says it is split."""
    return {name: why for name, why in killed.items()
            if name not in params or params[name].style == "replicate"}


def _all_shards(placements):
    for p in placements:
        if isinstance(p, (list, tuple)):
            yield from _all_shards(p)
        elif isinstance(p, Shard):
            yield p
