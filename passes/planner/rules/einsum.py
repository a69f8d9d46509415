"""The einsum core most rules share: every dimension has a label (see the package docstring).

:func:`einsum_rule` decides the output's placement from the operands' labels; the helpers
label the operands of pointwise ops and gather every input of an op that runs whole.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.core.placement import Partial, Replicate, Shard
from tpcompile.passes.planner.dims import shape, val


def einsum_rule(op, operands, out_labels, linear=None, matmul=False):
    """Propagate through an op whose operand dims carry labels (see module docstring).

    ``operands``: [(arg, labels)] with one label per dim (None: a broadcast size-1 dim).
    ``matmul``: a parameter operand (or a view of one) with a label that only it and the
    output carry may start a column-parallel root when every operand is replicated.
    With sequence parallelism, replicated and partial activations are put on sequence shards
    (partial ones by a reduce-scatter) and column-parallel matmuls gather their input first.
    """
    sharded, partial = _placed(op, operands)
    seq = op.sequence_label(out_labels)
    if not sharded:
        start = _unsharded(op, operands, out_labels, linear, matmul, partial, seq)
        if not isinstance(start, list):
            return start
        sharded = start
    label = _kept_label(sharded, operands, out_labels)
    if label is None:  # sharded along a dim the op does not map (e.g. a broadcast size-1 dim)
        for arg, _ in operands:
            op.require(arg, Replicate())
        return Replicate()
    if label == seq and all(lab == seq for _, lab, _ in sharded):
        column = op.gather_for_column(operands, out_labels) if matmul else None  # Megatron-SP
        if column is not None:
            return column
    kept = next(lay for _, lab, lay in sharded if lab == label)
    _gather_other_labels(op, operands, sharded, label, kept)
    same = [(operands[i][0], layout) for i, lab, layout in sharded if lab == label and i is not None]
    target = op.unify(same) if same else kept
    return _output(op, operands, out_labels, linear, partial, same, label, target)


def _placed(op, operands):
    """The operands' shards as (index, label, layout) (only shards whole on every rank, which
    follow the others' cut, when there are no others) and the indices of partial ones."""
    sharded, partial, whole = [], [], []
    for i, (arg, labels) in enumerate(operands):
        p = op.placement(arg)
        if isinstance(p, Shard):
            (whole if op.specs.is_full(p.layout) else sharded).append((i, labels[p.dim], p.layout))
        elif isinstance(p, Partial):
            partial.append(i)
    return sharded or whole, partial


def _unsharded(op, operands, out_labels, linear, matmul, partial, seq):
    """No operand is sharded: the output's placement, or (a list) the sequence shards the
    partial or replicated activations are put on under sequence parallelism."""
    if partial:
        if linear == "add" and len(partial) == len([o for o in operands if op.is_tensor(o[0])]):
            return Partial()
        if linear in ("mul", "unary") and len(partial) == 1:
            return Partial()
        if seq is None or not all(seq in operands[i][1] for i in partial):
            for i in partial:
                op.require(operands[i][0], Replicate())
            return Replicate()
        return [(i, seq, op.sequence_layout()) for i in partial]  # reduce-scatter them
    column = op.maybe_column_parallel(operands, out_labels) if matmul else None
    if column is not None or seq is None:
        return column or Replicate()
    return [(None, seq, op.sequence_layout())]  # replicated activation -> sequence shards


def _gather_other_labels(op, operands, sharded, label, kept):
    """Operands sharded on another label than the one kept are gathered."""
    for i, lab, layout in sharded:
        if lab == label:
            continue
        if layout.root == kept.root and op.is_chunk(layout):
            # two chunks of one fused weight cut on different dims: the other one is computed
            # whole (Mamba-2's B of one group against x's heads); anything else is gathered
            op.require_whole(f"{operands[i][0].name} is cut on another dim than "
                             f"{op.node.name}'s other operands", layout)
        op.require(operands[i][0], Replicate())


def _output(op, operands, out_labels, linear, partial, same, label, target):
    """The output of operands cut on ``label`` with ``target``: sharded where the output keeps
    the label, a partial sum where the op is linear in a label it sums over, else whole."""
    contracted = label not in out_labels
    if (contracted and linear == "mul" and len(same) > 1
            and all(op.is_chunk(lay) and op.param_behind(a) is None for a, lay in same)):
        # two activations cut on the dim they contract (Mamba-2's C . B over the state of a
        # fused in_proj's n_groups < ranks): a partial sum no chain ends with; those chunks
        # are computed whole instead (their weight rows replicated, no collective)
        names = ", ".join(a.name for a, _ in same)
        op.require_whole(f"{op.node.name} contracts the cut dim of {names}", *(lay for _, lay in same))
    if contracted and op.specs.is_full(target):
        # summed over a dim every rank holds whole (Mamba-2's C . B of one group): computed
        # whole, a replicated copy inside the chain (grad_syncs' _copies_of_whole_chunks)
        for i in partial:
            op.require(operands[i][0], Replicate())
        return Replicate()
    if contracted and (linear != "mul" or op.overlaps(target)):
        # a non-linear reduction over a sharded dim (softmax over heads' dim, norms) or a
        # sum over replicated blocks: both need the whole dim on every rank
        for arg, _ in same:
            op.require(arg, Replicate())
        return Replicate()
    for i, (arg, labels) in enumerate(operands):
        if label in labels:  # replicated operands are sliced, partial ones reduce-scattered
            op.require(arg, Shard(labels.index(label), target))
        elif i in partial:
            op.require(arg, Replicate())
    if contracted:
        return Partial()
    return Shard(out_labels.index(label), target)


def _kept_label(sharded, operands, out_labels):
    """Of operands sharded on different labels, the label kept is one the output keeps (a
    sharded output, not a partial sum of scores: x-transformers' multi-query
    ``einsum("b h i d, b j d -> b h i j")`` keeps q's heads, and the one kv head, cut by its
    head_dim, is gathered, so its root stays whole), then the one most operands carry
    (``B * decay[..., None]``: the heads both have, not the state dim only B has), then the
    first operand's."""
    rank = {lab: (lab in out_labels, sum(lab in labels for _, labels in operands))
            if lab is not None else (False, -1) for _, lab, _ in sharded}
    return max(rank, key=rank.get)


def broadcast_labels(args, out_shape):
    """Right-aligned labels for pointwise operands; broadcast size-1 dims get None."""
    n = len(out_shape)
    result = []
    for a in args:
        s = shape(a)
        labels = []
        for d, size in enumerate(s):
            o = d + n - len(s)
            labels.append(None if (isinstance(size, int) and size == 1 and out_shape[o] != 1) else o)
        result.append((a, labels))
    return result


def replicate_all(op):
    """The op runs on whole tensors: every tensor input is gathered / reduced first."""
    for a in tensor_args(op.node):
        op.require(a, Replicate())
    return Replicate()


def tensor_args(node):
    flat = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            flat.extend(x for x in a if isinstance(x, fx.Node))
        elif isinstance(a, fx.Node):
            flat.append(a)
    return [a for a in flat if isinstance(val(a), torch.Tensor)]
