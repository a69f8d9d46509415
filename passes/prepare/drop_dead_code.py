"""Drop pure ops nothing reads, so a dead read of a weight does not count as a use of it."""

from __future__ import annotations

from torch import fx
from torch._functorch import predispatch
from torch.fx.passes.infra.pass_base import PassResult

__all__ = ["drop_dead_code_pass"]

# vmap's level changes, which export records where ``create_block_mask`` runs inside forward:
# their results are unused (levels are constants in the graph) but each batched op between an
# increment and its decrement needs the level entered
_VMAP_LEVELS = frozenset({predispatch._vmap_increment_nesting,
                          predispatch._vmap_decrement_nesting})


def drop_dead_code_pass(gm: fx.GraphModule) -> PassResult:
    """Pure ops nothing reads are dropped: torch.export keeps them, e.g. the arguments
    transformers' Mamba-2 mixers evaluate for a fused kernel that returns None on CPU
    (``conv1d.weight.squeeze(1)``), which would otherwise count as a second use of the weight.
    Parameters and buffers stay (``get_attr`` nodes are kept whether read or not), and so do
    vmap's level changes."""
    changed = gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: n.op != "call_function" or n.is_impure()
        or n.target in _VMAP_LEVELS)
    return PassResult(gm, changed)
