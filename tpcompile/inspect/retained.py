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

__all__ = ["retained_bytes", "graph_retained_bytes"]


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Outputs(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns, by storage."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _WAIT and args[0].device.type == "meta":
            return args[0]  # see the module docstring
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not _is_wrapper(t):
                self.storages[_key(t)] = weakref.ref(t.untyped_storage())
        return out


def _is_wrapper(t: torch.Tensor) -> bool:
    """A tensor subclass without storage of its own (a functional collective's async result)."""
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def retained_bytes(forward: Callable[[], object], held: list[torch.Tensor]) -> int:
    """Bytes of the storages ``forward()``'s ops created that are alive once it returns (its
    result kept alive meanwhile), leaving out those of ``held`` (parameters, buffers,
    inputs: memory the caller counts elsewhere)."""
    skip = {_key(t) for t in held}
    with _Outputs() as mode:
        result = forward()
    total = 0
    for key, ref in mode.storages.items():
        storage = ref()
        if storage is not None and key not in skip:
            total += storage.nbytes()
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
