"""Placement propagation: run the rule table over the graph in topological order.

This is an analysis; it does not touch the graph. Given which matmuls may start a
column-parallel chain and how each root is cut, it returns every node's output placement and
the conversions (gathers, all-reduces, local slices) consumers need. The planner
(:mod:`tpcompile.passes.planner.plan_sharding`) calls it repeatedly while it refines those inputs.

Column parallelism is decided here, locally: a matmul whose activation is replicated and whose
weight is a parameter (trainable or frozen), or a view of one, shards the weight's label that
only it and the output carry (a new *root*, named by the parameter); a matmul whose activation
arrives sharded on the contracted dim shards its weight's input features to match (row
parallel) and produces a Partial sum. Chains therefore alternate column -> row exactly as
Megatron's do, whatever the modules are called. The planner's accumulated decisions arrive
as :class:`Constraints`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import fx

from tpcompile.core.placement import Demand, Layout, Misaligned, Partial, Replicate, RootSpec, Shard, Specs
from tpcompile.core.plan import PlanOptions
from tpcompile.passes.planner.dims import agreeing_cut, shape, sub_layout, val
from tpcompile.passes.planner.experts.placement import choose_column, grouped_mode, place_experts
from tpcompile.passes.planner.rules.quantized import dequantized_weight, stored_behind
from tpcompile.passes.planner.rules import is_lookup, is_view, piece_of, rule_for, shard_map

log = logging.getLogger(__name__)

__all__ = ["Propagation", "Constraints", "PlanOptions", "propagate", "view_chain", "carrier_chain",
           "weight_chain", "passes_cut", "value_readers", "bias_added", "local_slice", "same_placement", "visit"]

SEQUENCE = "<sequence>"  # the root every sequence-parallel activation is cut from


@dataclass
class Constraints:
    """What the planner has learnt so far; each propagation round reads it."""

    params: frozenset[str]                                  # parameter targets, frozen too
    options: PlanOptions = PlanOptions()
    killed: dict[str, str] = field(default_factory=dict)    # root -> why it stays whole
    demands: list[Demand] = field(default_factory=list)
    tied: set[str] = field(default_factory=set)             # roots embeddings must follow
    reduce_early: set[str] = field(default_factory=set)     # partial sums every consumer reads reduced
    carried: set[str] = field(default_factory=set)          # sums kept partial (carried_sums)
    seq_len: int | None = None                              # sequence parallelism: static length
    # in-place cache write -> the shard its readers slice (fewer kv heads than ranks: each
    # rank stores the heads its query heads read)
    cache_cuts: dict[str, object] = field(default_factory=dict)
    # values that may carry a gradient (grad_syncs.values_with_grad), set once by the planner
    needs_grad: frozenset = frozenset()
    # placeholder name -> its placement (default Replicate). It exists for rule tests
    # (tests/unit/test_rule_soundness.py); a Shard's root is cut as RootSpec.build would.
    inputs: dict[str, object] = field(default_factory=dict)


@dataclass
class Propagation:
    placements: dict[fx.Node, object] = field(default_factory=dict)
    conversions: dict[tuple[fx.Node, fx.Node], object] = field(default_factory=dict)
    roots: dict[str, fx.Node] = field(default_factory=dict)   # root name -> matmul node
    demands: list[Demand] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)  # roots that meet in one op
    rejected: dict[str, str] = field(default_factory=dict)      # root -> why a rule refused it
    root_users: dict[str, set] = field(default_factory=dict)    # root -> ops that shard it
    statistics: set = field(default_factory=set)  # nodes whose partial sum is a per-token statistic
    # op with no rule that met a sharded or partial input, or whose rule asked for its
    # decomposition -> why (planned again decomposed)
    no_rule: dict[fx.Node, str] = field(default_factory=dict)
    specs: Specs | None = None
    output: fx.Node | None = None
    experts: dict[str, tuple[str, str]] = field(default_factory=dict)  # stacked weight -> (mode, why)


def _is_tensor(arg) -> bool:
    return isinstance(arg, fx.Node) and isinstance(val(arg), torch.Tensor)


class OpView:
    """What a rule sees of one node: input placements, and a way to ask for conversions."""

    def __init__(self, node, state: Propagation, specs: Specs, constraints: Constraints):
        self.node, self._state, self.specs = node, state, specs
        self.constraints = constraints
        self.options = constraints.options
        self._demands = constraints.demands
        self.required: dict[fx.Node, object] = {}
        # a max / min partial reads as itself only in rules that know it (their ``extremal``);
        # every other rule reads it reduced
        rule = rule_for(node)
        self.reads_extrema = rule is not None and rule.extremal

    def is_tensor(self, arg) -> bool:
        return _is_tensor(arg)

    def placement(self, arg):
        """The placement the op reads ``arg`` in (a list for multi-output ops); R for constants.

        A partial sum the planner decided to reduce early reads as replicated everywhere.
        """
        p = self._produced(arg)
        if isinstance(p, Replicate) and (cut := self._stored_cut(arg)) is not None:
            self.required[arg] = cut
            return cut
        if isinstance(p, Partial) and (arg.name in self.constraints.reduce_early
                                       or (p.reduce != "sum" and not self.reads_extrema)):
            self.required.setdefault(arg, Replicate())
            return Replicate()
        return p

    def _stored_cut(self, arg) -> Shard | None:
        """The cut an integer matmul already asked of ``arg``, a view of quantized storage
        (``qdata.t()``): its other readers (the column sums of torchao's zero-point trick)
        read the same cut, so the storage is stored cut once."""
        if not isinstance(arg, fx.Node) or stored_behind(arg) is None:
            return None
        return next((c for u in arg.users if isinstance(c := self._state.conversions.get((arg, u)), Shard)),
                    None)

    def _produced(self, arg):
        p = self._state.placements.get(arg) if isinstance(arg, fx.Node) else None
        return Replicate() if p is None else p

    def require(self, arg, placement) -> None:
        if not _is_tensor(arg):
            return
        if not same_placement(self.specs, self._produced(arg), placement):
            self.required[arg] = placement
        else:
            self.required.pop(arg, None)

    def sum_is_carried(self) -> bool:
        """The planner carries this sum partial: replicated operands enter as rank 0's share
        (:mod:`tpcompile.passes.planner.refine.carried_sums`)."""
        return self.node.name in self.constraints.carried

    def reject(self, root: str, reason: str) -> None:
        """Keep ``root`` whole from the next round on (its chain stays otherwise as it is)."""
        self._state.rejected.setdefault(root, reason)

    def mark_statistic(self) -> None:
        """This op's partial sum is a per-token statistic (see ``_reduce`` in the rule table)."""
        self._state.statistics.add(self.node)

    def decompose(self, reason: str) -> None:
        """Plan this op again through its rule's ``decomposition`` (the pipeline rewrites it
        and replans); this round it runs as the rule placed it."""
        self._state.no_rule[self.node] = reason

    def overlaps(self, layout: Layout) -> bool:
        return self.specs.overlaps(layout)

    def check_aligned(self, layout: Layout) -> None:
        """Raise :class:`Misaligned` (a demand on the root) if ``layout`` cuts through a unit."""
        self.specs.ranges(layout)

    def require_block(self, layout: Layout) -> None:
        """The root indices ``layout`` covers must be whole blocks of its root's cut."""
        lo, hi = layout.covered()
        blocks = self.specs.roots[layout.root].blocks  # the root's own cuts, not the chunk's size
        cuts = {b.start for b in blocks} | {b.stop for b in blocks}
        demand = Demand(layout.root, lo, hi, reason=f"chunk [{lo}, {hi}) of {layout.root}")
        if (lo not in cuts or hi not in cuts) and demand not in self._demands:
            raise Misaligned(demand)

    def is_chunk(self, layout: Layout) -> bool:
        """``layout`` is a proper part of a fused root (a ``chunk`` / ``split`` of its output)
        not yet whole on every rank: a part that may be kept whole (:meth:`require_whole`)."""
        return (layout.covered() != (0, self.specs.roots[layout.root].size)
                and not self.specs.is_full(layout))

    def require_whole(self, reason: str, *layouts: Layout) -> None:
        """The root indices each layout covers are kept whole on every rank (MQA's k / v chunk
        of a fused qkv: each rank slices the heads its query heads read)."""
        demands = [d for d in (Demand(lay.root, *lay.covered(), replicate=True, reason=reason)
                               for lay in layouts) if d not in self._demands]
        if demands:
            raise Misaligned(*demands)

    def link(self, *roots: str) -> None:
        """The ``roots`` meet in this op: one chain, kept whole or cut together."""
        self._state.links.extend(zip(roots, roots[1:]))

    def unify(self, items: list[tuple[fx.Node, Layout]]) -> Layout:
        """One layout for operands sharded on the same label; the rest get converted to it."""
        target = items[0][1]
        for _, layout in items[1:]:
            self._state.links.append((target.root, layout.root))
            if self.specs.same(target, layout) or self.specs.contains(layout, target):
                continue
            if self.specs.contains(target, layout):
                target = layout  # narrow the wider operands to the more specific one
                continue
            demands = [d for d in agreeing_cut(target, layout) if d not in self._demands]
            if demands:
                raise Misaligned(*demands)
        return target

    def maybe_column_parallel(self, operands, out_labels, assume_replicated=()):
        """Start a column-parallel root at a parameter matmul with a replicated activation.

        The weight is a parameter or a view of one (``w.t()``, ``w.view(...)``); its column
        label is the first of its labels the output keeps and no activation has (``n`` of
        ``linear``, ``h`` of ``einsum("btd,dh->bth")``, the expert's output dim of a ``bmm``),
        or a stacked weight's expert dim under ``experts="expert"`` (:mod:`.experts.placement`).
        """
        if any(not isinstance(self.placement(a), Replicate) for a, _ in operands
               if a not in assume_replicated and _is_tensor(a)):
            return None
        weights = [(arg, labels) for arg, labels in operands if self.param_behind(arg) is not None]
        if len(weights) != 1:
            return None
        w, labels = weights[0]
        others = {lab for arg, lab_list in operands if arg is not w and not self.is_bias(arg, w)
                  for lab in lab_list}
        column = next((lab for lab in labels if lab is not None and lab in out_labels
                       and lab not in others), None)
        column = choose_column(self, w, labels, others, out_labels, column)
        layout = self.root_layout(w, labels.index(column)) if column is not None else None
        if layout is None:
            return None
        self.require(w, Shard(labels.index(column), layout))
        for arg, lab in operands:
            if arg is not w and column in lab:  # a bias over the same features
                self.require(arg, Shard(lab.index(column), layout))
        return Shard(out_labels.index(column), layout)

    def place_grouped_experts(self, w) -> None:
        """Record how the experts of a grouped matmul's weight ``w`` are asked to be cut, and
        why (:func:`~tpcompile.passes.planner.experts.placement.grouped_mode`)."""
        place_experts(self, w, *grouped_mode(self, w))

    @property
    def experts_placed(self) -> dict:
        """Stacked weight -> (mode, why) recorded this round (``Propagation.experts``)."""
        return self._state.experts

    def is_bias(self, arg, weight) -> bool:
        """A 1-D parameter beside the weight (``linear``'s bias) labels no activation dim."""
        return arg is not weight and self.is_param(arg) and len(shape(arg)) == 1

    def projected(self, arg: fx.Node, layout: Layout) -> bool:
        """``arg`` is, through views, casts and its bias (split off: ``split_bias``), the output
        of the matmul that starts ``layout``'s root: a column-parallel projection read as it
        is, not a sum it joined."""
        while arg.op == "call_function" and (passes_cut(arg) or bias_added(arg)):
            arg = arg.args[0]
        return any(self._state.roots.get(b) is arg for b in self.specs.bases(layout.root))

    def param_behind(self, arg) -> fx.Node | None:
        """The parameter ``arg`` is, or is a view of (through ops the rule table maps dims of,
        each used once), or the quantized weight it dequantizes
        (:mod:`tpcompile.passes.planner.rules.quantized`): where a column-parallel root may start.
        A matmul may also read a piece of a parameter split along a dim (:func:`piece_of`);
        ``root_layout`` then cuts that piece as its part of the parameter's root."""
        if isinstance(arg, fx.Node) and (stored := stored_behind(arg)) is not None:
            return stored
        piece = piece_of(arg) if isinstance(arg, fx.Node) else None
        node = piece[0] if piece is not None and len(arg.users) == 1 else arg
        while isinstance(node, fx.Node) and not self.is_param(node):
            if not passes_cut(node) or len(value_readers(node)) != 1:
                return dequantized_weight(arg) if isinstance(arg, fx.Node) else None
            node = node.args[0]
        return node if isinstance(node, fx.Node) and len(node.users) >= 1 else None

    def sequence_label(self, out_labels) -> object:
        """With sequence parallelism: the label of dim 1 of a (batch, seq, features) output."""
        t = self.constraints.seq_len
        out = val(self.node)
        if (t is None or self.specs.world_size < 2 or not isinstance(out, torch.Tensor)
                or out.dim() != 3 or out.shape[1] != t or not out.dtype.is_floating_point):
            return None
        return out_labels[1]

    def sequence_layout(self) -> Layout:
        t = self.constraints.seq_len
        if SEQUENCE not in self.specs.roots:
            self.specs.roots[SEQUENCE] = RootSpec.build(SEQUENCE, t, self.specs.world_size, [])
        return Layout(SEQUENCE, t)

    def gather_for_column(self, operands, out_labels):
        """A parameter matmul reading sequence shards gathers them first (Megatron-SP).

        Then it goes column-parallel, or, when its weight must stay whole (an LM head whose
        logits are gathered), computes replicated: gathering the input moves fewer bytes than
        gathering its output (features out >= in for LM heads) and needs no weight-gradient sync.
        """
        if not any(self.param_behind(a) is not None for a, _ in operands):
            return None
        activations = [a for a, _ in operands if isinstance(self.placement(a), Shard)]
        column = self.maybe_column_parallel(operands, out_labels, assume_replicated=activations)
        for a in activations:
            self.require(a, Replicate())
        return column or Replicate()

    def is_param(self, arg) -> bool:
        return isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in self.constraints.params

    def root_layout(self, w: fx.Node, dim: int) -> Layout | None:
        """The layout of parameter ``w`` split along ``dim`` as a root, or None if it may not be.

        A weight used by several ops (tied embeddings, shared layers) names one root, so every
        use that shards it agrees on the same cut.
        """
        param = self.param_behind(w)
        piece = piece_of(w)
        if piece is not None and (piece[0] is not param or piece[1] != dim):
            return None  # a piece of a view of it, or cut across another dim than its split's
        size = int(shape(param if piece is not None else w)[dim])
        name = param.target  # a view of a parameter is cut as the parameter
        if self.specs.world_size < 2 or size < self.specs.world_size or name in self.constraints.killed:
            return None
        if name not in self.specs.roots:
            mine = [d for d in self._demands if d.root == name]
            self.specs.roots[name] = RootSpec.build(name, size, self.specs.world_size, mine)
        self._state.roots.setdefault(name, self.node)
        self._state.root_users.setdefault(name, set()).add(self.node)
        if piece is None:
            return Layout(name, size)
        layout = sub_layout(Layout(name, size), piece[2], piece[3])
        self.require_block(layout)  # each piece is cut on its own, as a fused qkv's chunks
        return layout


def view_chain(node: fx.Node) -> list[fx.Node]:
    """``node`` and the views it alone feeds, one user each (``w -> t -> matmul``: [w, t]);
    the forward twin of :meth:`OpView.param_behind`."""
    return _chain(node, is_view, lambda n: list(n.users))


def carrier_chain(node: fx.Node) -> list[fx.Node]:
    """``node`` and the ops it alone feeds that carry a shard of it whole (views, elementwise
    ops: ``A_log -> float -> exp -> neg``): a weight at its head can be stored sharded and the
    shard carried down, instead of each rank slicing the chain's end. Export's metadata checks
    (no value) are not counted as users."""
    return _chain(node, lambda u: shard_map(u) is not None,
                  value_readers)


def bias_added(node: fx.Node) -> bool:
    """``y + b`` with ``b`` a stored 1-D tensor: a bias ``split_bias`` split off its matmul
    (``fuse_bias`` folds it back in)."""
    if node.target is not torch.ops.aten.add.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    b = node.args[1]
    return (isinstance(b, fx.Node) and b.op == "get_attr"
            and isinstance(bias := val(b), torch.Tensor) and bias.dim() == 1)


def passes_cut(node: fx.Node) -> bool:
    """A weight's cut passes through ``node`` unchanged: a view, or an elementwise op of one
    tensor that keeps its shape (a cast, ``w.bfloat16()``). A lookup carries a cut too, but it
    is the weight's reader."""
    return shard_map(node) is not None and not is_lookup(node)


def weight_chain(node: fx.Node) -> list[fx.Node]:
    """``node`` and the ops its cut passes through (:func:`passes_cut`), one value reader each:
    a weight and its views and casts up to the op that reads it."""
    return _chain(node, passes_cut, value_readers)


def value_readers(node: fx.Node) -> list[fx.Node]:
    """``node``'s users that read its values: export's metadata checks (no value) do not."""
    return [u for u in node.users if val(u) is not None]


def _chain(node: fx.Node, follows, users_of) -> list[fx.Node]:
    """``node``, then while the last node has exactly one user (``users_of``) that ``follows``
    and reads it as its first argument, that user."""
    chain = [node]
    while True:
        users = users_of(chain[-1])
        if len(users) != 1 or not follows(users[0]) or users[0].args[0] is not chain[-1]:
            return chain
        chain.append(users[0])


def local_slice(specs: Specs, src, dst) -> bool:
    """Converting ``src`` to ``dst`` needs no communication: each rank already holds its part
    (a shard of a block too small to split is whole on every rank: MQA's k / v chunk of a
    fused qkv, cut later by the query heads that read it)."""
    return (isinstance(src, Shard) and isinstance(dst, Shard)
            and (src.dim == dst.dim and specs.contains(src.layout, dst.layout)
                 or specs.is_full(src.layout)))


def same_placement(specs: Specs, a, b) -> bool:
    """``a`` and ``b`` place a value alike: the same dim of the same cut, or the same kind."""
    if isinstance(a, Shard) and isinstance(b, Shard):
        return a.dim == b.dim and specs.same(a.layout, b.layout)
    return a == b and not isinstance(a, Shard)


def propagate(gm: fx.GraphModule, world_size: int, constraints: Constraints) -> Propagation:
    """Placements of every node under the planner's current ``constraints``."""
    state = Propagation()
    specs = Specs(world_size)
    state.specs = specs
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            p = constraints.inputs.get(node.name, Replicate()) if node.op == "placeholder" else Replicate()
            if isinstance(p, Shard) and p.layout.root not in specs.roots:
                mine = [d for d in constraints.demands if d.root == p.layout.root]
                specs.roots[p.layout.root] = RootSpec.build(p.layout.root, p.layout.size, world_size, mine)
            state.placements[node] = p if _is_tensor(node) else None
            continue
        if node.op == "output":
            state.output = node
            op = OpView(node, state, specs, constraints)
            for arg in node.all_input_nodes:
                keep = constraints.options.loss_parallel and isinstance(op.placement(arg), Shard)
                if not keep:  # outputs are replicated unless sharded logits were asked for
                    op.require(arg, Replicate())
            _record(state, node, op.required)
            continue
        state.placements[node] = visit(node, state, specs, constraints)
    return state


def visit(node, state, specs, constraints):
    """``node``'s output placement by its rule (recording what the rule requires of its
    inputs in ``state``), or replicated with its inputs gathered where it has none."""
    rule = rule_for(node)
    op = OpView(node, state, specs, constraints)
    if rule is not None:
        try:
            out = rule.propagate(op)
            _record(state, node, op.required)
            return out
        except Misaligned as e:
            state.demands.extend(e.demands)
            reason = e.demands[0].reason
        except Exception as e:  # noqa: BLE001 - a rule that cannot follow an op replicates it
            log.warning("tpcompile: rule for %s failed (%s); replicating it", node.format_node(), e)
            reason = f"{_reading(node, state)}: its sharding rule failed ({type(e).__name__}: {e})"
    tensor_out = isinstance(val(node), (torch.Tensor, list, tuple))
    if rule is None and not tensor_out:
        return None  # sizes (sym_size of dynamic dims), asserts: nothing to place or convert
    inputs = [a for a in node.all_input_nodes if _is_tensor(a)]
    distributed = any(not isinstance(state.placements.get(a), Replicate) for a in inputs)
    if rule is None:
        reason = f"{_reading(node, state)} has no sharding rule"
        if distributed:
            state.no_rule[node] = reason
    op = OpView(node, state, specs, constraints)
    for a in inputs:
        op.require(a, Replicate())
    if distributed and any(isinstance(state.placements.get(a), Shard) for a in inputs):
        state.fallbacks[node.name] = reason
    _record(state, node, op.required)
    if not tensor_out:
        return None
    v = val(node)
    return [Replicate()] * len(v) if isinstance(v, (list, tuple)) else Replicate()


def _reading(node: fx.Node, state: Propagation) -> str:
    """``stack.default of S(2), S(2)``: an op and the placements it was given."""
    placements = ", ".join(str(state.placements.get(a)) for a in node.all_input_nodes
                           if _is_tensor(a))
    return f"{getattr(node.target, '__name__', node.target)} of {placements}"


def _record(state: Propagation, node: fx.Node, required: dict) -> None:
    for arg, placement in required.items():
        state.conversions[(arg, node)] = placement
        src = state.placements.get(arg)
        if local_slice(state.specs, src, placement):  # chains that must be cut alike
            state.links.append((src.layout.root, placement.layout.root))
