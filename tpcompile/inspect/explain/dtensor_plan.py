"""The plan in PyTorch's own vocabulary: a ``parallelize_module`` plan, where one exists.

``parallelize_module(model, mesh, {"layers.0.attention.wq": ColwiseParallel(), ...})`` shards
whole ``nn.Linear`` modules evenly (``torch.chunk`` sizes) and then runs the model's own
Python code on the local shards. A tpcompile chain (see :mod:`tpcompile.inspect.chains`) maps to it
one to one only when all of these hold, and each check below names what breaks otherwise:

* every sharded parameter is the weight (rows for colwise, columns for rowwise) or bias of an
  ``nn.Linear``, cut in one contiguous ``torch.chunk`` piece per rank: a fused qkv weight
  sharded per chunk, uneven whole-head shards and KV-head blocks replicated inside the chain
  have no DTensor layout;
* tpcompile inserts no collective or slice inside the chain (a fallback gather, a replicated
  operand sliced to the local heads): ``parallelize_module`` would run those ops on shards;
* the rank's graph uses the model's own shape constants: a model that writes
  ``view(B, T, n_heads, head_dim)`` needs tpcompile to rewrite 8 heads to 4, whereas
  ``parallelize_module`` needs the model to say ``view(B, T, -1, head_dim)``.

Chains that fail are left out of the plan (they stay replicated there, which is correct, only
less sharded) and listed with the reason.
"""

from __future__ import annotations

from torch import fx, nn

from tpcompile.inspect.chains import Chain
from tpcompile.errors import TPCompileError
from tpcompile.core.placement import Partial
from tpcompile.inspect.trace import RewriteTrace

__all__ = ["dtensor_styles", "to_parallel_styles"]

_DIM_OF_STYLE = {"colwise": 0, "rowwise": 1}


def _chunk_ranges(size: int, world_size: int) -> list[tuple[tuple[int, int], ...]]:
    """What DTensor's ``Shard`` holds per rank: ``torch.chunk`` pieces (possibly empty)."""
    step = -(-size // world_size)
    out = []
    for r in range(world_size):
        s, e = min(r * step, size), min((r + 1) * step, size)
        out.append(((s, e),) if e > s else ())
    return out


def _layout_problem(fqn: str, entry, plan) -> str | None:
    ranges = [tuple(r) for r in plan.specs.ranges(entry.placement.layout)]
    if ranges == _chunk_ranges(entry.placement.layout.size, plan.world_size):
        return None
    if any(len(r) > 1 for r in ranges):
        pieces = " + ".join(f"[{s}, {e})" for s, e in ranges[0])
        return (f"{fqn} is sharded per fused chunk (rank 0 holds {pieces}); DTensor's Shard "
                "holds one contiguous piece per rank")
    sizes = ", ".join(str(sum(e - s for s, e in r)) for r in ranges)
    chunks = ", ".join(str(sum(e - s for s, e in r))
                       for r in _chunk_ranges(entry.placement.layout.size, plan.world_size))
    return (f"{fqn} has uneven shards of sizes {sizes}; DTensor's Shard cuts "
            f"torch.chunk sizes {chunks}")


def _param_problem(fqn: str, entry, modules: dict, plan) -> str | None:
    owner, _, leaf = fqn.rpartition(".")
    if not isinstance(modules.get(owner), nn.Linear) or leaf not in ("weight", "bias"):
        return f"{fqn} is sharded but is not the weight or bias of an nn.Linear"
    want = _DIM_OF_STYLE.get(entry.style)
    if want is None or (leaf == "weight" and entry.placement.dim != want):
        return f"{fqn} is sharded on dim {entry.placement.dim} as {entry.style}"
    return _layout_problem(fqn, entry, plan)


def _chain_problem(chain: Chain, trace: RewriteTrace, modules: dict) -> str | None:
    plan = trace.plan
    if chain.replicated_blocks:
        return (f"{', '.join(chain.replicated_blocks)} keep KV-head blocks replicated inside the "
                "sharded attention (too few heads for every rank); DTensor has no such layout")
    by_fqn = {e.aliases[0]: e for e in plan.params.values()}
    for fqn in chain.colwise + chain.rowwise:
        problem = _param_problem(fqn, by_fqn[fqn], modules, plan)
        if problem:
            return problem
    problem = _boundary_problem(chain, trace)
    if problem:
        return problem
    for node, (before, after) in trace.relocalized.items():  # graph order: the first one
        if node not in chain.nodes:
            continue
        return (f"the model hard-codes sizes that tpcompile rewrites per rank ({node}: {before} "
                f"-> {after} on rank {trace.rank}); parallelize_module runs the model's own code "
                "on local shards and needs sizes taken from the tensors, e.g. "
                "view(B, T, -1, head_dim)")
    return None


def _partial_sources(value: fx.Node, plan) -> set[str]:
    """The nodes where the partial sums ``value`` carries are first produced."""
    sources, todo = set(), [value]
    while todo:
        node = todo.pop()
        partial = [a for a in node.all_input_nodes if isinstance(plan.placements.get(a.name), Partial)]
        todo += partial
        if not partial:
            sources.add(node.name)
    return sources


def _boundary_problem(chain: Chain, trace: RewriteTrace) -> str | None:
    """Data may enter a chain only through colwise Linears and leave only through rowwise ones.

    A carried sum is no problem: its replicated operand enters the row-parallel outputs'
    partial sum as rank 0's share (``summand``), and the partial sums it adds are the exits of
    several chains (a parallel block's attention and MLP). ``parallelize_module`` reduces each
    rowwise Linear's output and adds them whole: the same values, one all-reduce per chain."""
    plan = trace.plan
    nodes = {n.name: n for n in trace.gm.graph.nodes}
    exits = {e for c in trace.chains for e in c.exits}
    for c in plan.conversions:
        if c.kind == "summand":
            continue
        if c.user in chain.nodes:
            why = plan.fallbacks.get(c.user)
            return (f"tpcompile inserts {c.kind} of {c.value} before {c.user} inside the chain"
                    + (f" ({why})" if why else "")
                    + f"; parallelize_module would run {c.user} on local shards")
        if c.value in chain.nodes and c.kind != "all_reduce":
            return (f"the chain's {c.value} leaves it through {c.kind} (before {c.user}); "
                    "parallelize_module ends a chain only with a row-parallel all-reduce")
        stray = _partial_sources(nodes[c.value], plan) - exits if (
            c.value in chain.nodes) else set()
        if stray:
            return (f"tpcompile all-reduces partial sums of {', '.join(sorted(stray))}, which no "
                    "row-parallel nn.Linear produces; parallelize_module would leave them per rank")
    inner = [v for v in chain.synced if v not in chain.entries]
    if inner:
        return (f"the gradient of {inner[0]}, a replicated value used inside the chain, is "
                "all-reduced by tpcompile; parallelize_module would leave it per rank")
    return None


def _module_key(fqn: str, modules: dict) -> str:
    """A Linear's FQN for its weight (the plan's key); the parameter's own FQN otherwise."""
    owner = fqn.rpartition(".")[0]
    return owner if isinstance(modules.get(owner), nn.Linear) else fqn


def dtensor_styles(trace: RewriteTrace, model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``(module -> 'colwise' | 'rowwise', module -> why it has no DTensor equivalent)``."""
    modules = dict(model.named_modules())
    styles, missing = {}, {}
    for chain in trace.chains:
        owned = {_module_key(fqn, modules): style
                 for style, names in (("colwise", chain.colwise), ("rowwise", chain.rowwise),
                                      ("replicate", chain.replicated_blocks))
                 for fqn in names if not fqn.endswith(".bias")}
        problem = _chain_problem(chain, trace, modules)
        if problem:
            missing.update((m, problem) for m in owned)
        else:
            styles.update(owned)
    return dict(sorted(styles.items())), dict(sorted(missing.items()))


def to_parallel_styles(styles: dict[str, str], missing: dict[str, str], strict: bool) -> dict:
    """``parallelize_module``'s plan: module FQN -> ``ColwiseParallel()`` / ``RowwiseParallel()``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if strict and missing:
        module, why = next(iter(missing.items()))
        raise TPCompileError(
            f"{len(missing)} sharded module(s) have no parallelize_module equivalent, e.g. "
            f"{module}: {why}\n  hint: call to_dtensor_plan() without strict=True to get the "
            "plan for the other modules (those stay replicated), or see not_expressible")
    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {module: make[style]() for module, style in styles.items()}
