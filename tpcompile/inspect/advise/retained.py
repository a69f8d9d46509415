"""What one forward leaves alive for backward, measured by running it: activation memory.

``torch.autograd.graph.saved_tensors_hooks`` sees only what autograd saves outside a
checkpointed region: it misses the inputs a non-reentrant ``checkpoint`` keeps to recompute
from, and the outputs a selective checkpoint caches. :func:`retained_bytes` counts instead
every storage an op of the forward created that is still alive when the forward returns
(weak references to the storages, which PyTorch keeps as long as any tensor or saved value
uses them), parameters and buffers excluded: the activation memory a training step holds at
the forward / backward boundary, whatever keeps it. The forward's own output counts (the loss
reads it).

The same function measures a real parallelized module on CPU (the tests) and estimates a
configuration in ``advise``: :func:`graph_retained_bytes` runs rank 0's rewritten graph, its
checkpointed regions outlined as ``parallelize`` outlines them, on meta tensors (functional
collectives have meta kernels; meta storages have sizes but no memory). On meta tensors
``scaled_dot_product_attention`` would take its math path and save every score matrix;
:func:`graph_retained_bytes` runs it as the fused kernel PyTorch picks on CPU and on GPUs
(flash / memory-efficient attention): what backward keeps is the output and its log-sum-exp.
And a collective's ``wait_tensor`` returns its input there (on a device it waits in place),
where the meta kernel would count a second copy of every collective's output.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from tpcompile.passes import pipeline

__all__ = ["LiveStorages", "storage_keys", "retained_bytes", "graph_retained_bytes"]


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LiveStorages(TorchDispatchMode):
    """While on: every storage an op returns, held weakly by its key (views share it), the
    bytes of those still alive (:meth:`alive`) and their most at once (``peak``). Storages in
    ``skip`` (parameters, inputs: memory counted elsewhere) are left out."""

    def __init__(self, skip: set[int] = frozenset()):
        super().__init__()
        self.skip, self.storages, self.peak = set(skip), {}, 0

    def alive(self) -> int:
        self.storages = {k: ref for k, ref in self.storages.items() if ref() is not None}
        return sum(ref().nbytes() for ref in self.storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _WAIT and args[0].device.type == "meta":
            return args[0]  # see the module docstring
        out = func(*args, **(kwargs or {}))
        self.alive()  # a freed storage's key may come back: forget it first
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not _is_wrapper(t) and _key(t) not in self.skip:
                self.storages.setdefault(_key(t), weakref.ref(t.untyped_storage()))
        self.peak = max(self.peak, self.alive())
        return out


def storage_keys(tensors) -> set[int]:
    """The keys :class:`LiveStorages` skips for ``tensors`` (a DTensor's: its local tensor's)."""
    return {_key(t.to_local() if hasattr(t, "to_local") else t)
            for t in tensors if isinstance(t, torch.Tensor)}


def _is_wrapper(t: torch.Tensor) -> bool:
    """A tensor subclass without storage of its own (a functional collective's async result)."""
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def retained_bytes(forward: Callable[[], object], held: list[torch.Tensor]) -> int:
    """Bytes of the storages ``forward()``'s ops created that are alive once it returns (its
    result kept alive meanwhile), leaving out those of ``held`` (parameters, buffers,
    inputs: memory the caller counts elsewhere)."""
    with LiveStorages(storage_keys(held)) as mode:
        result = forward()
    total = mode.alive()
    del result
    return total


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """``scaled_dot_product_attention`` through a fused kernel (see the module docstring);
    grouped KV heads the kernel does not take are repeated first, as the math path does."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        times = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(times, -3), v.repeat_interleave(times, -3)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def graph_retained_bytes(gm: fx.GraphModule, inputs: tuple, checkpointing: str | None) -> int:
    """:func:`retained_bytes` of rank 0's rewritten ``gm`` (weights on the meta device) with
    ``parallelize``'s ``activation_checkpointing``, run on ``inputs`` moved to meta."""
    graph = pipeline.copy_graph(gm)
    for node in graph.graph.nodes:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            node.target = _fused_attention
    graph.recompile()
    pipeline.outline(graph, checkpointing)
    meta = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    held = list(graph.parameters()) + list(graph.buffers()) + \
        [x for x in meta if isinstance(x, torch.Tensor)]
    return retained_bytes(lambda: graph(*meta), held)
