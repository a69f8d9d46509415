"""The torch APIs that differ across the supported releases (2.11 to 2.14), in one place.

tpcompile is planned and tested against each release in that range (``bench/compat.sh``);
where an API it calls changed between them, the difference is bridged here by asking torch
what it has (a feature check, never a version comparison), so the rest of the package calls
one spelling. Each entry names the release that introduced what it bridges.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import fx

__all__ = ["stack_traces", "new_group"]


@contextlib.contextmanager
def stack_traces(record: bool):
    """Capture inside the block keeps the model's source lines on nodes only if ``record``.

    Yields ``settle(gm)``, to be called on each graph captured in the block. torch 2.13 added
    ``torch.fx.config.do_not_emit_stack_traces`` (not recording them saves a sixth of export's
    time), and ``settle`` does nothing; before it, export always records them and ``settle``
    drops them when ``record`` is false, so the graph is the same on every release.
    """
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield (lambda gm: None) if record else _drop_stack_traces
        return
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = not record
    try:
        yield lambda gm: None
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved


def _drop_stack_traces(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        node.meta.pop("stack_trace", None)


_NEW_GROUP_ARGS = frozenset(inspect.signature(dist.new_group).parameters)


def new_group(ranks: list[int], **kwargs):
    """``dist.new_group`` with the keywords this release knows.

    ``sort_ranks=False`` (torch 2.13) keeps a group's ranks in the order given; a release
    without it sorts them, which is the same group for the sorted rank lists tpcompile passes.
    """
    if kwargs.get("sort_ranks") is False and "sort_ranks" not in _NEW_GROUP_ARGS:
        if list(ranks) != sorted(ranks):
            raise NotImplementedError(
                f"a process group over ranks {list(ranks)} in this order needs torch >= 2.13 "
                "(dist.new_group(sort_ranks=False))")
        del kwargs["sort_ranks"]
    return dist.new_group(ranks, **kwargs)
