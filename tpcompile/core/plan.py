"""The sharding plan: the planner's decision as plain, frozen, printable, JSON-serialisable data.

A plan is keyed by parameter FQNs and FX node names, never by ``Node`` objects, so it can be
printed, diffed, compared across ranks and written to disk. It is rank-independent: one plan
describes every rank, and per-rank shard ranges are computed from its root specs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property

from tpcompile.core.placement import Block, Layout, Partial, Placement, Replicate, RootSpec, Shard, Specs

__all__ = ["PlanOptions", "ParamPlan", "Conversion", "ShardingPlan", "placement_to_json",
           "placement_from_json"]


def placement_to_json(p):
    if isinstance(p, (list, tuple)):
        return [placement_to_json(x) for x in p]
    if p is None:
        return None
    if isinstance(p, Shard):
        return {"shard": p.dim, "layout": asdict(p.layout)}
    return str(p)


def placement_from_json(obj):
    if isinstance(obj, list):
        return [placement_from_json(x) for x in obj]
    if obj is None:
        return None
    if isinstance(obj, dict):
        return Shard(obj["shard"], Layout(**obj["layout"]))
    if obj == "R":
        return Replicate()
    return Partial(obj[2:-1]) if obj.startswith("P(") else Partial()


EXPERT_MODES = ("tensor", "expert", "auto")


@dataclass(frozen=True)
class PlanOptions:
    """User choices that change the plan (they are part of the plan's fingerprint).

    ``vocab_parallel``: shard token-embedding tables by vocabulary rows (masked lookup, one
    all-reduce) and the LM head by its output rows (logits all-gathered where the model returns
    them, as Megatron's output layer). ``loss_parallel``: leave sharded outputs (logits of a column-parallel LM head)
    sharded instead of gathering them, for :func:`tpcompile.sharded_cross_entropy`.
    ``sequence_parallel``: run the code between chains (norms, residuals, dropout) on sequence
    shards of dim 1: row-parallel outputs are reduce-scattered, column-parallel inputs gathered.
    ``experts``: how stacked expert weights (a parameter whose leading dim is a batch dim of
    its matmul, ``bmm`` over ``(experts, out, in)``) are cut: ``"tensor"`` splits each
    expert's matrices column -> row like any MLP; ``"expert"`` gives each rank whole experts
    (the batch dim cut), the sum over experts a partial sum all-reduced once; ``"auto"``
    picks by a cost model (``passes/planner/experts/placement.py``), and expert-TP under sequence
    parallelism, whose sequence-sharded tokens whole experts cannot take without an
    all-to-all dispatch (not implemented: ``"expert"`` with it is refused).
    ``chain_cost``: the device whose constants price per-sample chains (conditioning MLPs on
    one row per sample), kept whole where they do not pay
    (``passes/planner/chain_cost.py``), or ``"off"`` to shard every chain found.
    """

    vocab_parallel: bool = False
    loss_parallel: bool = False
    sequence_parallel: bool = False
    experts: str = "tensor"
    chain_cost: str = "cuda"

    def __post_init__(self):
        if self.experts not in EXPERT_MODES:
            raise ValueError(f"experts must be one of {EXPERT_MODES}, got {self.experts!r}")
        if self.experts == "expert" and self.sequence_parallel:
            raise ValueError('experts="expert" is planned without sequence parallelism only (whole '
                             "experts need every token; an all-to-all dispatch is not "
                             'implemented): use experts="tensor" or "auto", which fall back to '
                             "expert-TP with sequence_parallel=True")

    @property
    def static_dims(self) -> tuple[int, ...]:
        """Input dims capture keeps at their example size: SP cuts dim 1 into fixed shards."""
        return (1,) if self.sequence_parallel else ()


@dataclass(frozen=True)
class ParamPlan:
    """How one parameter (or buffer) is laid out on the ranks."""

    name: str                         # the get_attr target in the captured graph
    aliases: tuple[str, ...]          # every FQN naming the same tensor (tied weights)
    style: str                        # colwise | rowwise | expert | replicate
    placement: Placement
    global_shape: tuple[int, ...]
    local_shapes: tuple[tuple[int, ...], ...]  # per rank
    grad_sync: bool                   # its gradient is all-reduced (replicated inside a chain)
    reason: str


@dataclass(frozen=True)
class Conversion:
    """A value that a consumer needs in another placement: the collectives of the plan.

    ``sum_grads``: the consumer differentiates the converted (replicated) value only partially
    per rank (it feeds a sharded chain), so the conversion's backward must sum over ranks:
    a gather's backward becomes a reduce-scatter, an all-reduce's backward an all-reduce.

    ``kind`` names what it costs: ``all_reduce`` (+``slice``), ``all_gather`` (+``slice``),
    ``slice`` (local, no communication), and ``summand``: a replicated value entering a
    partial sum as rank 0's share (zeros on the others; no communication, and its gradient
    whole on every rank: ``passes/planner/refine/carried_sums.py``).
    """

    value: str
    user: str
    src: Placement
    dst: Placement
    sum_grads: bool = False

    @property
    def kind(self) -> str:
        s, d = self.src, self.dst
        if isinstance(s, Partial):
            return "all_reduce" if isinstance(d, Replicate) else "all_reduce+slice"
        if isinstance(d, Partial):
            return "summand"  # R -> P: rank 0 keeps the value, the others add zeros
        if isinstance(s, Shard) and isinstance(d, Replicate):
            return "all_gather"
        if isinstance(s, Shard) and isinstance(d, Shard) and s.dim != d.dim:
            return "all_gather+slice"
        return "slice"  # R -> S, or S -> a sub-layout of itself: a local view, no communication


@dataclass(frozen=True)
class ShardingPlan:
    world_size: int
    params: dict[str, ParamPlan]
    placements: dict[str, object]          # node name -> Placement (list for multi-output ops)
    conversions: tuple[Conversion, ...]
    # replicated value whose gradient is all-reduced -> the users that read its synced copy
    # (those whose gradient arrives as per-rank partial sums)
    grad_syncs: dict[str, tuple[str, ...]]
    roots: dict[str, RootSpec]
    fallbacks: dict[str, str] = field(default_factory=dict)   # node -> why it was gathered
    replicated: dict[str, str] = field(default_factory=dict)  # weight -> why kept whole
    options: PlanOptions = PlanOptions()
    outputs: tuple = ()                    # placement of each flat graph output
    notes: tuple[str, ...] = ()            # what capture changed about the call
    # why no backward may run through the graph (custom autograd Functions traced through in
    # an inference-only capture); "" when it may be trained
    inference_only: str = ""
    # module of stacked expert weights -> how its experts are cut, and why (options.experts)
    experts: dict[str, str] = field(default_factory=dict)

    def output_layouts(self) -> dict[int, Layout]:
        """Flat outputs left sharded on their last dim (``loss_parallel``): index -> layout."""
        return {i: p.layout for i, p in enumerate(self.outputs) if isinstance(p, Shard)}

    @cached_property
    def by_fqn(self) -> dict[str, ParamPlan]:
        """Every name of a tensor in the plan (its get_attr target, every tied alias) -> entry."""
        return {n: e for e in self.params.values() for n in (e.name, *e.aliases)}

    @cached_property
    def converted(self) -> dict[tuple[str, str], object]:
        """(value, user) node names -> the placement ``user`` reads ``value`` in."""
        return {(c.value, c.user): c.dst for c in self.conversions}

    @property
    def specs(self) -> Specs:
        return Specs(self.world_size, dict(self.roots))

    def placement(self, node_name: str):
        return self.placements.get(node_name)

    def styles(self) -> dict[str, str]:
        return {p.name: p.style for p in self.params.values()}

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> str:
        obj = {
            "world_size": self.world_size,
            "params": {k: {**asdict(v), "placement": placement_to_json(v.placement)}
                       for k, v in self.params.items()},
            "placements": {k: placement_to_json(v) for k, v in self.placements.items()},
            "conversions": [{"value": c.value, "user": c.user, "src": placement_to_json(c.src),
                             "dst": placement_to_json(c.dst), "sum_grads": c.sum_grads}
                            for c in self.conversions],
            "grad_syncs": {k: list(v) for k, v in self.grad_syncs.items()},
            "roots": {k: {"name": r.name, "size": r.size, "world_size": r.world_size,
                          "blocks": [asdict(b) for b in r.blocks]} for k, r in self.roots.items()},
            "fallbacks": self.fallbacks,
            "replicated": self.replicated,
            "options": asdict(self.options),
            "outputs": placement_to_json(list(self.outputs)),
            "notes": list(self.notes),
            "inference_only": self.inference_only,
            "experts": self.experts,
        }
        return json.dumps(obj, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "ShardingPlan":
        obj = json.loads(text)
        params = {}
        for k, v in obj["params"].items():
            v = dict(v)
            v["placement"] = placement_from_json(v["placement"])
            v["aliases"] = tuple(v["aliases"])
            v["global_shape"] = tuple(v["global_shape"])
            v["local_shapes"] = tuple(tuple(s) for s in v["local_shapes"])
            params[k] = ParamPlan(**v)
        roots = {k: RootSpec(r["name"], r["size"], r["world_size"],
                             tuple(Block(**b) for b in r["blocks"])) for k, r in obj["roots"].items()}
        return ShardingPlan(
            world_size=obj["world_size"],
            params=params,
            placements={k: placement_from_json(v) for k, v in obj["placements"].items()},
            conversions=tuple(Conversion(c["value"], c["user"], placement_from_json(c["src"]),
                                         placement_from_json(c["dst"]), c["sum_grads"])
                              for c in obj["conversions"]),
            grad_syncs={k: tuple(v) for k, v in obj["grad_syncs"].items()},
            roots=roots,
            fallbacks=obj["fallbacks"],
            replicated=obj["replicated"],
            options=PlanOptions(**obj.get("options", {})),
            outputs=tuple(placement_from_json(obj.get("outputs", []))),
            notes=tuple(obj.get("notes", ())),
            inference_only=obj.get("inference_only", ""),
            experts=obj.get("experts", {}),
        )

    # ------------------------------------------------------------------ printing
    def __str__(self) -> str:
        rows = [("parameter", "style", "global -> local (rank 0)")]
        for p in sorted(self.params.values(), key=lambda p: p.name):
            shape = "x".join(map(str, p.global_shape))
            local = "x".join(map(str, p.local_shapes[0]))
            note = " (grad all-reduced)" if p.grad_sync else ""
            rows.append((" = ".join(p.aliases), p.style + note, f"{shape} -> {local}"))
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"ShardingPlan(world_size={self.world_size})"]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in width))
        for name, why in sorted(self.replicated.items()):
            lines.append(f"  kept replicated: {name}: {why}")
        for name, why in sorted(self.fallbacks.items()):
            lines.append(f"  fallback: {name}: {why}")
        lines += [f"  experts: {m}: {how}" for m, how in sorted(self.experts.items())]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
