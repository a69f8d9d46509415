"""Flex attention's ``BlockMask`` as a call input, and flex attention traced with gradients on CPU.

torch.export takes only pytree containers as inputs, and torch (2.13) registers no pytree node
for :class:`~torch.nn.attention.flex_attention.BlockMask`, though the class carries its own
``_flatten`` / ``_unflatten``: a model whose forward takes one (torchtitan's language models)
is refused with ``Unsupported input type``. :func:`register_block_mask` registers it with those methods. Its leaves are the mask's
block tensors and the tensors its ``mask_mod`` closes over (a document mask's sequence ids),
so they are inputs of the graph and a later call's mask is read, not the capture's; its
context (sequence lengths, block sizes, the ``mask_mod``'s code) is part of the call check, so
a mask of another length or with another ``mask_mod`` is refused by
:class:`tpcompile.runtime.inputs.InputSpec` rather than run with the captured one.

``BlockMask._flatten`` skips the closure extraction while torch compiles or exports, so the
spec export records would never equal a later call's; :func:`_flatten` runs it with the flag
cleared, outside Dynamo.

:func:`flex_sizes_fixed` names a Hugging Face flex-attention model, captured at the example's
sizes.

``flex_attention`` refuses inputs that require grad on CPU, for its compiled kernels; the
higher-order op it traces to (``torch.ops.higher_order.flex_attention``) runs eagerly on CPU
with a dense backward, which tests/unit/test_capture_block_masks.py checks against attention
written out in plain tensor ops.
:func:`flex_capture` lifts that check while export traces, so the captured graph calls the op.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tpcompile.core.cache_configs import reachable_configs

__all__ = ["register_block_mask", "flex_capture", "static_leaves", "flex_sizes_fixed"]

try:
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # a build without flex attention
    _flex = None


def _flatten(mask):
    if torch.compiler.is_dynamo_compiling():
        return mask._flatten()
    saved = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = False
    try:
        return mask._flatten()
    finally:
        torch.compiler._is_compiling_flag = saved


def _flatten_with_keys(mask):
    leaves, context = _flatten(mask)
    attrs = [a for a in mask._TENSOR_ATTRS if getattr(mask, a) is not None]
    keys = attrs + [f"_closure_{i}" for i in range(len(leaves) - len(attrs))]
    return [(pytree.GetAttrKey(k), leaf) for k, leaf in zip(keys, leaves)], context


def register_block_mask() -> None:
    """Make ``BlockMask`` a pytree node, once, where torch has not (a release that registers
    it itself, or one whose BlockMask cannot flatten, is left as it is)."""
    if _flex is None or not hasattr(_flex.BlockMask, "_flatten"):
        return
    if _flex.BlockMask in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        _flex.BlockMask, _flatten, _flex.BlockMask._unflatten,
        flatten_with_keys_fn=_flatten_with_keys,
        serialized_type_name="torch.nn.attention.flex_attention.BlockMask")


def static_leaves(value):
    """Export's dynamic-shape spec for a registered pytree class (a BlockMask): its flattened
    leaves, each static (a block mask is built for one sequence length); None for any other
    value."""
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is None or type(value) in pytree.BUILTIN_TYPES:
        return None
    return tuple(None for _ in node.flatten_fn(value)[0])


def flex_sizes_fixed(model: nn.Module) -> str:
    """Why ``model`` is captured at the example's sizes only ('' when it is not): a Hugging Face
    model with ``attn_implementation="flex_attention"`` builds its block mask in forward
    (``create_block_mask`` compiled, over a mask_mod of its position ids), which torch.export
    (torch 2.13) cannot trace with symbolic sizes, and a failed dynamic attempt spoils export's
    state for the static one that would follow in the same process: the static capture comes
    first."""
    if not any(getattr(c, "_attn_implementation", None) == "flex_attention"
               for c in reachable_configs(model)):
        return ""
    return ("captured with static shapes: a Hugging Face model with attn_implementation="
            "'flex_attention' builds its block mask in forward, which torch.export cannot trace "
            "with dynamic sizes; the module accepts only the example's sizes")


@contextlib.contextmanager
def flex_capture():
    """Inside the block ``flex_attention`` traces CPU inputs that require grad."""
    check = getattr(_flex, "_validate_device", None)
    if check is None:
        yield
        return

    def validate(query, key, value):
        if query.device.type != "cpu":
            check(query, key, value)

    _flex._validate_device = validate
    try:
        yield
    finally:
        _flex._validate_device = check
