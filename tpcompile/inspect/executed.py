"""The collectives a parallelized module executes, counted while it runs: the report's check.

``explain`` (and :func:`~tpcompile.runtime.collectives.count_collectives`) read the collectives
off the rank's rewritten graph: each inserted call stands for the collectives its forward and
backward issue. That is a claim about the run, and this module measures the run itself: a
``TorchDispatchMode`` sees every ``torch.ops._c10d_functional`` (and ``c10d``) op the module
dispatches during one forward and during the backward of that forward's outputs, so a
gradient sync whose backward never fires (its value reaches no output) or a reduce-scatter
run as an all-reduce shows as a difference from the report.

It runs on any process group, the fake one included (``dist.init_process_group("fake",
...)``, torch.testing's ``FakeStore``): its collectives return garbage but are dispatched, so
one process can count what rank 0 issues at any world size.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_executed_collectives", "CollectiveRecorder", "KINDS"]

# the dispatched op's name -> the kind explain reports; waits carry no data and are not counted
KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
_NAMESPACES = ("_c10d_functional", "c10d")
_NOT_COUNTED = {"wait_tensor", "wait", "barrier", "monitored_barrier_"}


class CollectiveRecorder(TorchDispatchMode):
    """Counts the collective ops dispatched while active, by kind, into ``counts``.

    An op outside :data:`KINDS` is counted under its own name, so a new kind of collective
    shows up in a comparison instead of vanishing from it.
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket._qualified_op_name  # '_c10d_functional::all_reduce'
        namespace, _, op = name.partition("::")
        if namespace in _NAMESPACES and op not in _NOT_COUNTED:
            kind = KINDS.get(op, op)
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


def _loss(outputs) -> torch.Tensor | None:
    """Every floating output that carries a gradient, summed: the backward reaches each of
    them, as a training loss built from all the outputs would (the report assumes so)."""
    tensors = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)
               and t.requires_grad and t.is_floating_point()]
    if not tensors:
        return None
    return sum(t.float().sum() for t in tensors)


def count_executed_collectives(module, inputs: tuple, kwargs: dict | None = None, *,
                               warmup: int = 2, backward: bool = True) -> dict:
    """``{"forward": {kind: n}, "backward": {kind: n}}``: what one call of ``module`` and the
    backward of its outputs dispatch on this rank, the shape ``Report.collective_counts()``
    and ``count_collectives`` return.

    ``warmup`` uncounted calls run first, so the counts are those of a warm call: a
    ``TPModule`` checks that the ranks agree on each new kind of call (an all-reduce on a side
    group, :mod:`tpcompile.runtime.calls`), and the second call of a training loop is new too
    (it follows a backward); from the third on the check is quiet.
    ``backward=False`` counts the forward only (inference). Gradients the backward
    accumulates into the module's parameters are cleared again, so a training loop's
    ``.grad`` is left as it was.
    """
    kwargs = kwargs or {}
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for _ in range(warmup):
        _call(module, inputs, kwargs, backward, CollectiveRecorder(), CollectiveRecorder())
    forward, back = CollectiveRecorder(), CollectiveRecorder()
    _call(module, inputs, kwargs, backward, forward, back)
    for p, g in zip(params, grads):
        p.grad = g
    return {"forward": forward.counts, "backward": back.counts}


def _call(module, inputs, kwargs, backward, forward, back) -> None:
    with forward:
        outputs = module(*inputs, **kwargs)
    loss = _loss(outputs) if backward and torch.is_grad_enabled() else None
    if loss is not None:
        with back:
            loss.backward()
