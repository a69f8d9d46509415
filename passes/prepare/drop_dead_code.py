"""Drop pure ops nothing reads, so a dead read of a weight does not count as a use of it."""

from __future__ import annotations

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

__all__ = ["drop_dead_code_pass"]


def drop_dead_code_pass(gm: fx.GraphModule) -> PassResult:
    """Pure ops nothing reads are dropped: torch.export keeps them, e.g. the arguments
    transformers' Mamba-2 mixers evaluate for a fused kernel that returns None on CPU
    (``conv1d.weight.squeeze(1)``), which would otherwise count as a second use of the weight.
    Parameters and buffers stay (``get_attr`` nodes are kept whether read or not)."""
    changed = gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: n.op != "call_function" or n.is_impure())
    return PassResult(gm, changed)
