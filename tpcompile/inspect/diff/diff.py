"""``tpcompile.diff``: the graph before and after the rewrite, as code people can read.

The captured graph and one rank's rewritten graph are rendered as FX Python code with the
noise taken out (the ``x = None`` frees) and every parameter's shape written next to it, so
that the three things the rewrite does stand out in a unified diff: sharded parameters (their
shape comment changes), rewritten shape constants (``view(.., 8, 8)`` -> ``view(.., 4, 8)``)
and inserted collectives (added lines calling ``tpcompile_runtime_collectives_*``). Every pass can be
diffed on its own, and :meth:`GraphDiff.to_html` draws the same as a side-by-side page.
"""

from __future__ import annotations

import difflib
import operator
import re
from dataclasses import dataclass
from typing import Callable

from torch import fx, nn

from tpcompile.inspect.diff.diff_html import page
from tpcompile.core.placement import Partial, Shard, each
from tpcompile.core.plan import PlanOptions
from tpcompile.inspect.trace import trace_rewrite
from tpcompile.inspect.traffic import list_collectives

__all__ = ["GraphDiff", "diff", "render_code"]

_FREES = re.compile(r";\s+(?:\w+ = )+None$")


def _dims(shape) -> str:
    return "x".join(str(s) for s in shape) or "scalar"


def render_code(gm: fx.GraphModule) -> str:
    """``gm.code`` without the frees, each parameter's line noting its shape (and the global
    shape where the tensor is a shard of it)."""
    notes = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or "val" not in node.meta:
            continue
        held = tuple(operator.attrgetter(node.target)(gm).shape)
        whole = tuple(node.meta["val"].shape)
        notes[node.name] = _dims(held) if held == whole else f"{_dims(held)}, shard of {_dims(whole)}"
    lines = []
    for line in gm.code.splitlines():
        if not line.strip():
            continue
        line = _FREES.sub("", line)
        var = line.strip().split(" = ", 1)[0]
        lines.append(f"{line}  # {notes[var]}" if var in notes else line)
    return "\n".join(lines) + "\n"


def _kind(placement) -> str:
    """The CSS class of a node's placement: shard, partial or '' (replicated)."""
    ps = each(placement)
    if any(isinstance(p, Shard) for p in ps):
        return "shard"
    return "partial" if any(isinstance(p, Partial) for p in ps) else ""


@dataclass
class GraphDiff:
    """The rendered graph after capture and after every pass of one rank's rewrite."""

    model: str
    world_size: int
    rank: int
    stages: list                 # [(name, code)]: "capture" first, then one per pass
    placements: dict             # node name -> "shard" | "partial" (absent: replicated)
    collectives: list            # [traffic.CollectiveEntry] the rewrite inserted
    relocalized: list            # names of nodes whose shape constants the rank rewrote
    passes: bool = False         # default view: one diff per pass instead of the whole

    def pairs(self, passes: bool | None = None) -> list[tuple[str, str, str]]:
        """``(title, before, after)`` per diff shown: the whole rewrite, or each pass."""
        if not (self.passes if passes is None else passes):
            return [(f"captured -> rank {self.rank} of {self.world_size}",
                     self.stages[0][1], self.stages[-1][1])]
        return [(f"pass {name}", before, after)
                for (_, before), (name, after) in zip(self.stages, self.stages[1:])]

    def summary(self) -> list[str]:
        lines = [f"tpcompile diff: {self.model}, rank {self.rank} of {self.world_size}"]
        ops: dict[str, list[str]] = {}
        for c in self.collectives:
            ops.setdefault(f"{c.inserted_as} after {c.node}", []).append(f"{c.phase} {c.op}")
        lines.append("inserted collectives: " + (", ".join(
            f"{where} ({', '.join(what)})" for where, what in ops.items()) or "none"))
        lines.append("rewritten shape constants: " + (", ".join(self.relocalized) or "none"))
        return lines

    def unified(self, passes: bool | None = None) -> str:
        out = [f"# {line}" for line in self.summary()]
        for title, before, after in self.pairs(passes):
            body = list(difflib.unified_diff(
                before.splitlines(), after.splitlines(), fromfile=f"{self.model} ({title}: before)",
                tofile=f"{self.model} ({title}: after)", lineterm=""))
            out += [f"# === {title}"] + (body or ["# (no change)"])
        return "\n".join(out) + "\n"

    def __str__(self) -> str:
        return self.unified()

    def to_html(self, passes: bool | None = None) -> str:
        return page(self, passes)


def diff(model: nn.Module, example_inputs, world_size: int, *, rank: int = 0,
         passes: bool = False, html: bool = False,
         progress: Callable[[str], None] | None = None, example_kwargs: dict | None = None,
         **options):
    """Rewrite rank ``rank``'s graph for ``world_size`` ranks and diff it against the capture.

    Returns a :class:`GraphDiff` (``str()`` of it is the unified diff; ``passes=True`` makes
    that one diff per pass), or with ``html=True`` the self-contained side-by-side HTML page.
    Needs no process group; a model on the meta device is diffed without memory.
    ``example_kwargs`` and ``options`` are ``parallelize``'s, as for :func:`tpcompile.explain`.
    """
    trace = trace_rewrite(model, example_inputs, world_size, rank, render=render_code,
                          progress=progress, example_kwargs=example_kwargs,
                          options=PlanOptions(**options))
    placements = {name: _kind(p) for name, p in trace.plan.placements.items() if _kind(p)}
    result = GraphDiff(trace.model_name, world_size, rank, trace.stages, placements,
                       list_collectives(trace), list(trace.relocalized), passes)
    return result.to_html() if html else result
