"""Mark the nodes each ``torch.utils.checkpoint.checkpoint`` call of the model produces.

torch.export inlines a checkpointed call: the captured graph is the plain forward, and the
recomputation the user asked for is gone (the parallelized model would keep every activation).
During capture, :func:`checkpoint_marks` makes each checkpoint call trace its function inside
``torch.fx.traceback.annotate``: export (non-strict) then records the call's id in
``node.meta["custom"]`` of every node it produces. :func:`stamp_regions` copies that id to
``node.meta[REGION]`` on every node of the captured graph (``None`` outside a region), so a
node the passes insert later is recognisable by the key's absence
(:mod:`tpcompile.passes.rewrite.checkpoint_regions` gives it the region of its neighbours).

Both variants are caught where ``checkpoint`` looks them up in its own module, so a model that
imported the function by name (``from torch.utils.checkpoint import checkpoint``, Hugging
Face's ``gradient_checkpointing_enable``) is seen too: ``use_reentrant=False`` through its
context generator, ``use_reentrant=True`` through ``CheckpointFunction.apply`` (a custom
autograd Function the capture would otherwise refuse). A checkpoint inside another belongs to
the outer region. Annotations are recorded only while node metadata is preserved, which is
switched on for the duration of the checkpointed call alone: the rest of the graph is captured
exactly as without checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch.utils.checkpoint as torch_checkpoint
from torch import fx, nn
from torch.fx import traceback as fx_traceback

__all__ = ["REGION", "checkpoint_marks", "stamp_regions"]

REGION = "tpcompile_checkpoint_region"  # node.meta key: the region's name, or None


def _describe(function, paths: dict[int, str]) -> str:
    """A region's name for messages: the module it runs ('layers.0'), else the function's.

    The module is the function itself, the object of a bound method, or the first argument
    bound by a ``functools.partial`` (Hugging Face checkpoints ``partial(forward, layer)``).
    """
    owners = []
    while isinstance(function, functools.partial):
        owners += function.args[:1]
        function = function.func
    owners += [getattr(function, "__self__", function)]
    for owner in owners:
        if id(owner) in paths:
            return paths[id(owner)] or "the model"
    return getattr(function, "__qualname__", type(function).__name__)


class _Recorder:
    """Names the checkpoint calls of one capture, in call order: 'checkpoint 0 (layers.0)'."""

    def __init__(self, model: nn.Module):
        self.paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.counter = itertools.count()
        self.names: list[str] = []
        self.depth = 0

    @contextlib.contextmanager
    def region(self, function):
        """Trace ``function``'s call as one region (or as part of the enclosing one)."""
        if self.depth:
            yield
            return
        name = f"checkpoint {next(self.counter)} ({_describe(function, self.paths)})"
        self.names.append(name)
        self.depth += 1
        try:
            with fx_traceback.preserve_node_meta(), fx_traceback.annotate({REGION: name}):
                yield
        finally:
            self.depth -= 1


@contextlib.contextmanager
def checkpoint_marks(model: nn.Module):
    """Inside the block, checkpoint calls trace their function as a marked region.

    Yields the list of region names recorded (empty when the model checkpoints nothing).
    """
    recorder = _Recorder(model)

    def without_reentrant(function, *args, **kwargs):  # checkpoint() resumes it once, after
        with recorder.region(function):                # calling function(*args)
            yield

    class Reentrant:  # stands in for CheckpointFunction while tracing
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            with recorder.region(function):
                return function(*args)

    saved = (torch_checkpoint._checkpoint_without_reentrant_generator,
             torch_checkpoint.CheckpointFunction)
    torch_checkpoint._checkpoint_without_reentrant_generator = without_reentrant
    torch_checkpoint.CheckpointFunction = Reentrant
    try:
        yield recorder.names
    finally:
        (torch_checkpoint._checkpoint_without_reentrant_generator,
         torch_checkpoint.CheckpointFunction) = saved


def stamp_regions(gm: fx.GraphModule) -> None:
    """Copy each node's region from export's annotation to ``node.meta[REGION]``."""
    for node in gm.graph.nodes:
        node.meta[REGION] = (node.meta.get("custom") or {}).get(REGION)
