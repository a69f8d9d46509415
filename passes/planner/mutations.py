"""In-place ops (``relu_``, ``add_``, ``x[:, :k] = 0``) under a sharding plan.

torch.export keeps in-place ops in the graph it captures, and their meaning depends on storage:
every view of the written tensor sees the write. On each rank the write stays exact as long as
it reaches the same local tensor the unsharded program writes into. It does not when the plan
converts the written tensor (or a view of it on the way) first: a gather, an all-reduce, a
local slice or a gradient sync hands the op a *copy*, and anything that later reads the
original, or a view taken before the write, would miss it. So:

- :func:`write_conflicts` (an analysis) accepts a converted write only when nothing reads the
  original afterwards (the common ``h = fc(x); h.relu_()``). Inputs and buffers count as read
  afterwards: the caller or the next call sees them. The planner keeps the sharded data of
  every other write replicated (slice assignment into a sharded activation), and
  :func:`check_mutations` raises :class:`PlanError` naming the op if that did not resolve it.
- :func:`tpcompile.passes.rewrite.clone_converted_writes.clone_converted_writes_pass` then
  gives such a write a plain copy to write into: a gather's output is a view created inside
  tpcompile's autograd Functions, which autograd does not allow to be modified in place.
"""

from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass
from typing import Callable

from torch import fx

from tpcompile.errors import PlanError
from tpcompile.core.plan import ShardingPlan

__all__ = ["written_args", "aliased_input", "aliases", "WriteConflict", "write_conflicts",
           "check_mutations"]


def written_args(node: fx.Node) -> list[fx.Node]:
    """The tensors an op writes into (its schema's ``Tensor(a!)`` arguments)."""
    out = []
    for i, name in _written_positions(node.target) if node.op == "call_function" else ():
        v = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        out.extend(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, fx.Node))
    return out


@functools.cache
def _written_positions(target) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``target``'s schema writes into: the planner asks
    this of every user of every slice, so it is read off the schema once per op."""
    schema = getattr(target, "_schema", None)
    return tuple((i, arg.name) for i, arg in enumerate(schema.arguments if schema else ())
                 if arg.alias_info is not None and arg.alias_info.is_write)


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output shares (a view or an in-place op), or None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:  # one output of a split: a view of the split's input
        return node.args[0] if aliased_input(node.args[0]) is not None else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def aliases(node: fx.Node) -> set[fx.Node]:
    """``node`` and everything that shares its storage downstream (views, in-place results)."""
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(u for u in n.users if aliased_input(u) is n)
    return out


def _where(node: fx.Node) -> str:
    """' (model.py:12: h[:, :2] = 0)': the model line that wrote, from the captured trace."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)', node.meta.get("stack_trace") or "")
    return f" ({frames[-1][0]}:{frames[-1][1]}: {frames[-1][2].strip()})" if frames else ""


@dataclass
class WriteConflict:
    """An in-place ``op`` whose write reaches converted data that ``readers`` still read."""

    op: fx.Node
    written: fx.Node
    edge: tuple[fx.Node, fx.Node]   # (value, user) where the written data is converted
    chain: list[fx.Node]            # written, then the tensors it is a view of, to its base
    readers: list[str]


def write_conflicts(gm: fx.GraphModule, converted: Callable[[fx.Node, fx.Node], bool]):
    """Every in-place write that would land on a copy someone still reads.

    ``converted(value, user)``: whether ``user`` reads ``value`` through a conversion.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for node in gm.graph.nodes:
        for written in written_args(node):
            edges, base = [(written, node)], written
            while (src := aliased_input(base)) is not None:
                edges.append((src, base))
                base = src
            hit = next(((u, v) for u, v in edges if converted(u, v)), None)
            if hit is None:
                continue  # each rank writes into its own part of the same tensor
            stale = aliases(base) - aliases(node)
            late = sorted({u.name for n in stale for u in n.users if order[u] > order[node]})
            if base.op in ("placeholder", "get_attr"):
                late.insert(0, f"{base.name} (an input or buffer: the caller sees it)")
            if late:
                out.append(WriteConflict(node, written, hit, [v for _, v in edges] + [base], late))
    return out


def check_mutations(gm: fx.GraphModule, state, plan: ShardingPlan) -> ShardingPlan:
    """``plan``, or :class:`PlanError` if an in-place write would land on a copy someone still
    reads.

    The planner keeps such writes' sharded data replicated; this is the check on its result
    (it reads the plan, not the propagation ``state``).
    """
    converted = plan.converted
    synced = set(plan.grad_syncs)
    conflicts = write_conflicts(gm, lambda u, v: (u.name, v.name) in converted or u.name in synced)
    if not conflicts:
        return plan
    c = conflicts[0]
    value, user = c.edge
    needed = converted.get((value.name, user.name), "R with a gradient all-reduce")
    writes = c.written.name if value is c.written else f"{c.written.name} (a view of {value.name})"
    raise PlanError(
        f"in-place op {c.op.target} at node {c.op.name}{_where(c.op)} writes into {writes}; "
        f"{value.name} is placed {plan.placement(value.name)} but {user.name} reads it as "
        f"{needed}, so the write would land on a copy while {', '.join(c.readers)} still read "
        "the original\n  hint: write it out of place (`h = h.relu()`, "
        "`torch.where(mask, v, h)`, `torch.cat` instead of slice assignment)")
