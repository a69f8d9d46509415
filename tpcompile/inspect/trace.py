"""One rank's rewrite taken step by step: what ``explain`` and ``diff`` both read.

Inspection runs the pipeline ``parallelize`` runs (:mod:`tpcompile.passes.pipeline`) and keeps
what it needs of each step: the graph as each pass leaves it (for ``diff``), the shape constants a rank gets
instead of the model's (for the DTensor comparison), and progress lines while a large model
is traced. Nothing here needs a process group: collectives are inserted into the graph, never
run, so a laptop can inspect a 64-rank plan of a model built on the meta device.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from tpcompile.core.capture import Capture, concrete_shape, module_path
from tpcompile.inspect.bound.bound import Bound, megatron_bound
from tpcompile.inspect.chains import Chain, find_chains
from tpcompile.errors import TPCompileError
from tpcompile.passes import pipeline
from tpcompile.core.plan import PlanOptions, ShardingPlan

__all__ = ["RewriteTrace", "trace_rewrite", "concrete_shape", "module_path", "source_node",
           "source_line"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)')
_TORCH_DIR = os.path.dirname(torch.__file__)
# the pass a rewrite without weights leaves out (explain's; the other ranks' graphs of a trace)
_NO_WEIGHTS = ("materialize_params",)


@dataclass
class RewriteTrace:
    model_name: str
    cap: Capture
    plan: ShardingPlan
    gm: fx.GraphModule               # the rank's rewritten graph; nodes keep the capture's meta
    rank: int
    stages: list[tuple[str, str]]    # ("capture", rendering), then (pass name, rendering after it)
    # node -> (constants before, after) where the rank's graph differs from the model's
    relocalized: dict[str, tuple[list, list]]
    chains: list[Chain]              # found on the planned graph, before the rewrite
    chain_of: dict[str, str]         # node name -> its chain's name
    bound: Bound                     # Megatron's plan of the model, derived without the plan


def _literals(node: fx.Node) -> list:
    """The non-Node leaves of a node's arguments: the constants a pass may rewrite."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [x for x in leaves if not isinstance(x, fx.Node)]


def _tell(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)


def trace_rewrite(model: nn.Module, example_inputs, world_size: int, rank: int = 0, *,
                  example_kwargs: dict | None = None, options: PlanOptions = PlanOptions(),
                  render: Callable[[fx.GraphModule], str] | None = None,
                  copy_weights: bool = True, group_name: str = "tp",
                  progress: Callable[[str], None] | None = None,
                  dynamic: bool = True, reuse_blocks: bool = True) -> RewriteTrace:
    """Capture, plan for ``world_size`` ranks and rewrite rank ``rank``'s graph.

    ``example_kwargs`` and ``options`` are ``parallelize``'s (vocabulary, loss and sequence
    parallelism), so the trace is what that call would run. ``render``: a ``gm -> str``
    snapshot taken after capture and after every pass (the diff's input); None keeps none. ``copy_weights=False`` skips ``materialize_params``: the
    report needs the graph, not a copy of every weight of a real 7B model. ``dynamic=False``
    captures with static shapes (see :func:`tpcompile.core.capture.capture`);
    ``reuse_blocks`` exports three identical blocks and repeats one (:mod:`tpcompile.core.stamp`).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise TPCompileError(f"need world_size >= 1 and 0 <= rank < world_size, got world_size "
                             f"{world_size}, rank {rank}\n  hint: ranks are numbered from 0")
    name = type(model).__name__
    n_params = sum(p.numel() for p in model.parameters())
    _tell(progress, f"capturing {name} ({n_params:,} parameters) with torch.export")
    planned = pipeline.plan(model, example_inputs, world_size, example_kwargs, options=options,
                            dynamic=dynamic, stack_traces=True, record=render or False,
                            reuse_blocks=reuse_blocks,
                            progress=progress or (lambda message: None))
    cap, plan = planned.cap, planned.plan
    chains, chain_of = find_chains(cap.gm, plan)
    bound = megatron_bound(cap, world_size, options.chain_cost)
    before = {n.name: _literals(n) for n in cap.gm.graph.nodes if n.op == "call_function"}
    _tell(progress, f"rewriting the graph of rank {rank}")
    gm, records = pipeline.rewrite(planned, rank, group_name, record=render or False,
                                   skip=() if copy_weights else _NO_WEIGHTS)
    stages = [("capture", planned.records[0].before)] if render else []
    stages += [(r.name, r.after) for r in list(planned.records) + records]
    relocalized = {}
    for node in gm.graph.nodes:
        if node.name in before and _literals(node) != before[node.name]:
            relocalized[node.name] = (before[node.name], _literals(node))
    return RewriteTrace(name, cap, plan, gm, rank, stages, relocalized, chains, chain_of, bound)


def rewrite_rank(trace: RewriteTrace, rank: int, group_name: str = "tp") -> fx.GraphModule:
    """Rank ``rank``'s rewritten graph from ``trace``'s plan, captured and planned once: what
    differs between ranks (uneven shards' sizes and offsets) without a capture per rank."""
    planned = pipeline.Planned(trace.cap, trace.plan)
    return pipeline.rewrite(planned, rank, group_name, skip=_NO_WEIGHTS)[0]


def source_node(node: fx.Node, known: set[str] | dict) -> fx.Node:
    """The captured node behind a node a pass inserted (a collective's input chain)."""
    while node.name not in known and node.op == "call_function" and node.args:
        first = node.args[0]
        if not isinstance(first, fx.Node):
            break
        node = first
    return node


def source_line(node: fx.Node) -> str:
    """'models.py:227: return self.output(self.norm(x))': the model's line behind ``node``.

    The innermost frame of the captured stack trace outside torch itself: an ``nn.Linear``'s
    own frame (torch/nn/modules/linear.py) says nothing about which of the model's calls it is.
    '' when the capture kept no trace (``trace_rewrite`` always keeps one).
    """
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    mine = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
    if not mine:
        return ""
    path, line, code = mine[-1]
    return f"{os.path.basename(path)}:{line}: {code.strip()}"
