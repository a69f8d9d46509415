"""``flex_attention`` (the higher-order op): cut by heads like SDPA, with the head index its
``score_mod`` and ``mask_mod`` read made global on every rank.

torch.export captures ``torch.nn.attention.flex_attention`` as
``torch.ops.higher_order.flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options,
score_mod_other_buffers, mask_mod_other_buffers)``: ``score_mod`` and ``mask_mod`` (the last
entry of the ``block_mask`` tuple) are graph modules called per score with ``(score, b, h,
q_idx, kv_idx, *buffers)`` and ``(b, h, q_idx, kv_idx, *buffers)``; the op returns ``(out,
lse, max_scores)``. Heads are independent, so q, k and v cut alike on dim 1 (kv heads with
their group of query heads under GQA, as :func:`.attention.grouped_heads` places them) keep
every output cut there. Each rank then calls the mods with its *local* head index; a mod
that reads it (ALiBi's slope ``2 ** (-8 * (h + 1) / H)``, a per-head mask) would restart at 0
on every rank, so :func:`_localize_flex` gives each rank's mods ``h + first head`` instead.

A block mask's tensors shared by all heads (head dim 1) and the tensors the mods close over
(a slope table indexed by the global ``h``, a document mask's ids) are read whole; a block
mask with one entry per query head is cut with the heads. Batch and positions are never cut
here: the mods read ``b``, ``q_idx`` and ``kv_idx`` as global indices too.
"""

from __future__ import annotations

import copy

import torch
from torch import fx

from tpcompile.core.placement import Replicate, Shard
from tpcompile.errors import PlanError
from tpcompile.passes.planner.dims import hinted_shape, shape
from tpcompile.passes.planner.rules.attention import grouped_heads, kv_read_whole
from tpcompile.passes.planner.rules.einsum import einsum_rule
from tpcompile.passes.planner.rules.table import register

_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)
# which placeholder of each mod is the head index: score_mod(score, b, h, ...), mask_mod(b, h, ...)
_HEAD_ARG = {"score_mod": 2, "mask_mod": 1}


def _operands(node: fx.Node):
    """(q, k, v, {mod name: its get_attr node}, block-mask tensors, the mods' buffers)."""
    q, k, v, score_mod, block_mask = node.args[:5]
    buffers = [b for group in node.args[7:9] for b in group]
    masks = [t for t in block_mask[:-1] if isinstance(t, fx.Node)]
    return q, k, v, {"score_mod": score_mod, "mask_mod": block_mask[-1]}, masks, buffers


def _flex_flops(node: fx.Node) -> tuple[float, list[fx.Node]]:
    """2·S·B·Hq·L·(E + Ev): the scores and their product with v, as SDPA's (no mask discount);
    a shard of q (its heads) divides them."""
    q, _, v = node.args[:3]
    b, h, length, e = hinted_shape(q)
    s, ev = hinted_shape(v)[-2:]
    return 2.0 * s * b * h * length * (e + ev), [q]


def _flex(op):
    """q cut by heads: k, v on the kv heads those read, per-head block-mask tensors on the
    query heads, everything else whole; the three outputs cut like q. Anything else: all whole."""
    q, k, v, _, masks, buffers = _operands(op.node)
    hq, hk = shape(q)[1], shape(k)[1]
    per_head = [m for m in masks if len(shape(m)) > 1 and shape(m)[1] == hq > 1]
    for t in buffers + [m for m in masks if m not in per_head]:
        op.require(t, Replicate())
    pq = op.placement(q)
    if not (isinstance(pq, Shard) and pq.dim == 1):
        for t in (q, k, v, *per_head):
            op.require(t, Replicate())
        return [Replicate()] * 3
    kv_read_whole(op, q, k, v)
    if hq != hk:
        out = Shard(1, grouped_heads(op, q, k, v, [(m, 1) for m in per_head]))
        return [out] * 3
    heads = [None, "h", None, None]
    operands = [(x, heads) for x in (q, k, v)] + [(m, heads[:len(shape(m))]) for m in per_head]
    out = einsum_rule(op, operands, heads)
    return [out] * 3


def _localize_flex(node: fx.Node, local) -> None:
    """Each mod that reads its head index gets ``h + first head of this rank``."""
    out = local.out_placements(node)[0]
    if not isinstance(out, Shard):
        return
    ranges = local.specs.ranges(out.layout)[local.rank]
    if len(ranges) != 1:
        raise PlanError(
            f"{node.name}: rank {local.rank} holds query heads {list(ranges)} of flex attention, "
            "not one run of heads, and its score_mod / mask_mod read the head index\n  hint: "
            "use a number of heads the world size divides")
    gm = node.graph.owning_module
    for name, mod in _operands(node)[3].items():
        if isinstance(mod, fx.Node) and mod.op == "get_attr":
            _global_heads(gm, node, mod, _HEAD_ARG[name], ranges[0][0])


def _global_heads(gm: fx.GraphModule, node: fx.Node, mod: fx.Node, index: int, first: int):
    """Point ``node`` at a copy of the mod ``mod`` names whose head placeholder is shifted by
    ``first`` (the mod itself when it never reads the head index, or ``first`` is 0)."""
    sub = getattr(gm, mod.target)
    h = [n for n in sub.graph.nodes if n.op == "placeholder"][index]
    if not h.users or first == 0:
        return
    name = f"{mod.target}_heads_from_{first}"
    if not hasattr(gm, name):
        shifted = copy.deepcopy(sub)
        h = [n for n in shifted.graph.nodes if n.op == "placeholder"][index]
        with shifted.graph.inserting_after(h):
            global_h = shifted.graph.call_function(torch.ops.aten.add.Tensor, (h, first))
        h.replace_all_uses_with(global_h, delete_user_cb=lambda user: user is not global_h)
        shifted.recompile()
        gm.add_submodule(name, shifted)
    with gm.graph.inserting_before(node):
        node.replace_input_with(mod, gm.graph.get_attr(name))


if _FLEX is not None:
    register(_FLEX, localize=_localize_flex, attention=True, flops=_flex_flops)(_flex)
