"""Vocabulary parallelism: an embedding table cut by rows gives a partial lookup, logits cut by
vocabulary a vocabulary-parallel cross entropy."""

from __future__ import annotations

import re

import torch
from torch import fx

from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.runtime.limits import SAME_VALUES
from tpcompile.runtime.vocab import vocab_parallel_cross_entropy, vocab_parallel_embedding
from tpcompile.passes.planner.dims import shape
from tpcompile.passes.planner.rules.table import register
from tpcompile.passes.planner.rules.einsum import replicate_all

aten = torch.ops.aten


# an input holding positions, not token ids, by the names models give it (Hugging Face's
# position_ids and cache_position, gpt-fast's input_pos): a position table looked up by it
# is no vocabulary, whether the model computes its positions (parallelize's call) or is
# handed them (generate's static-cache wrapper), so both captures cut the same tables
POSITIONS = re.compile(r"position|(^|_)pos(_|$)")


def _from_inputs(node) -> bool:
    """Indices that come from the caller (token ids), not computed in the model or passed
    as positions (:data:`POSITIONS`)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in SAME_VALUES:
        node = node.args[0]
    return (isinstance(node, fx.Node) and node.op == "placeholder"
            and not POSITIONS.search(node.name))


def token_tables(gm: fx.GraphModule) -> list[str]:
    """The get_attr targets of the tables ``embedding`` looks the caller's token ids up in
    (not positions computed in the model): the tables ``vocab_parallel`` asks to cut."""
    out = []
    for node in gm.graph.find_nodes(op="call_function", target=aten.embedding.default):
        table, ids = node.args[:2]
        if (isinstance(table, fx.Node) and table.op == "get_attr" and _from_inputs(ids)
                and table.target not in out):
            out.append(table.target)
    return out


def vocabulary_heads(gm: fx.GraphModule, roots: dict) -> set[str]:
    """The roots (of ``roots``: name -> :class:`RootSpec`) that cut a vocabulary: a weight with
    as many rows as a token table (the table itself when tied), an LM head. ``vocab_parallel``
    cuts it whatever its logits cost: gathered where the model returns them whole, as Megatron's
    output layer, and never judged by the cost rule (generate's head reads one row per
    sample)."""
    tables = token_tables(gm)
    rows = {shape(n)[0] for n in gm.graph.find_nodes(op="get_attr") if n.target in tables}
    return {r for r, spec in roots.items() if not spec.parts and spec.size in rows}


def _contiguous(op, layout) -> bool:
    return all(len(r) == 1 for r in op.specs.ranges(layout)) and not op.overlaps(layout)


@register(aten.embedding.default, lookup=True, localize=lambda node, local: _localize_embedding(node, local),
          carries=lambda node, p: Shard(len(shape(node)) - 1, p.layout) if p.dim == 1 else None)
def _embedding(op):
    """A table sharded by vocabulary rows gives a Partial lookup (ids elsewhere read zeros).

    Any other lookup runs on the whole table. Its ``carries`` (a table's column is the output's
    last dim) lets the planner store the table cut by columns when every reader wants the
    output cut there (``_absorb_params``): T5's and CPM-Ant's relative position bias, a
    (buckets, heads) table read per head."""
    w, ids = op.node.args[:2]
    wanted = op.is_param(w) and (w.target in op.constraints.tied or (
        op.options.vocab_parallel and _from_inputs(ids)))
    layout = op.root_layout(w, 0) if wanted else None
    if layout is not None and _contiguous(op, layout):
        op.require(w, Shard(0, layout))
        op.require(ids, Replicate())
        return Partial()
    return replicate_all(op)


def _localize_embedding(node, local):
    p = local.consumed(node.args[0], node)
    if isinstance(p, Shard) and p.dim == 0:  # by rows; a column shard looks up its columns
        (start, stop), = local.specs.ranges(p.layout)[local.rank]
        pad = node.args[2] if len(node.args) > 2 else -1
        local.replace_target(node, vocab_parallel_embedding,
                             (node.args[0], node.args[1], start, stop, pad, p.layout.size))


@register(aten.cross_entropy_loss.default,
          localize=lambda node, local: _localize_cross_entropy(node, local))
def _cross_entropy(op):
    """Logits sharded by vocabulary: a vocabulary-parallel loss, the logits never gathered."""
    x, target = op.node.args[:2]
    args = list(op.node.args) + [None, 1, -100, 0.0][len(op.node.args) - 2:]
    weight, label_smoothing = op.node.kwargs.get("weight", args[2]), op.node.kwargs.get(
        "label_smoothing", args[5])
    p = op.placement(x)
    class_dim = 1 if len(shape(x)) >= 2 else 0
    if (isinstance(p, Shard) and p.dim == class_dim and weight is None and not label_smoothing
            and _contiguous(op, p.layout)):
        op.require(target, Replicate())
        return Replicate()
    return replicate_all(op)


def _localize_cross_entropy(node, local):
    x, target = node.args[:2]
    p = local.consumed(x, node)
    if not isinstance(p, Shard):
        return
    (start, stop), = local.specs.ranges(p.layout)[local.rank]
    args = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
    reduction = node.kwargs.get("reduction", args[3])
    ignore_index = node.kwargs.get("ignore_index", args[4])
    node.kwargs = {}
    local.replace_target(node, vocab_parallel_cross_entropy,
                         (x, target, p.dim, start, stop, reduction, ignore_index, local.group,
                          p.layout.size))
