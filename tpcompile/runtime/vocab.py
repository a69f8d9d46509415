"""Vocabulary parallelism: an embedding table and a loss over logits sharded by vocabulary.

Each rank holds a contiguous range ``[start, stop)`` of the vocabulary. The embedding looks up
only the ids in its range (others read zero rows), so summing over ranks (one all-reduce,
inserted by the planner because the lookup is a ``Partial``) gives the full embedding. The
cross-entropy never gathers the logits: the log-sum-exp is assembled from per-rank maxima and
sums, and each target's logit from the one rank that holds it; the backward needs no
communication at all.
"""

from __future__ import annotations

import torch
from torch._subclasses import FakeTensor

from tpcompile.runtime.collectives import COLLECTIVE_FNS, plain_all_reduce
from tpcompile.errors import InputError

__all__ = ["check_ids", "vocab_parallel_embedding", "vocab_parallel_cross_entropy",
           "sharded_cross_entropy"]

MEAN, SUM = 1, 2  # torch's Reduction enum as aten.cross_entropy_loss takes it


def check_ids(ids: torch.Tensor, vocab: int | None, what: str, ignore_index: int | None = None):
    """Ids outside ``[0, vocab)`` raise, as in the unsharded model (IndexError there): on a
    sharded table no rank holds them, so they would silently read zeros (or drop out of the
    loss). One reduction and one host sync per call; skipped under torch.compile and for
    tensors without data (fake or meta: shape checks and planning)."""
    if (vocab is None or torch.compiler.is_compiling() or ids.device.type == "meta"
            or isinstance(ids, FakeTensor)):
        return
    valid = ids if ignore_index is None else ids[ids != ignore_index]
    if bool(((valid < 0) | (valid >= vocab)).any()):
        raise InputError(
            f"{what}: token ids must be in [0, {vocab}), got values from {int(valid.min())} to "
            f"{int(valid.max())}\n  hint: the unsharded model would raise IndexError on them too; "
            "check the tokenizer's vocabulary size against the model's")


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, stop: int,
                             padding_idx: int = -1, vocab: int | None = None) -> torch.Tensor:
    """This rank's partial lookup: rows for ids in ``[start, stop)``, zeros elsewhere.

    ``vocab``: the whole table's rows, to refuse ids no rank holds (see :func:`check_ids`).
    """
    check_ids(ids, vocab, "vocabulary-parallel embedding")
    inside = (ids >= start) & (ids < stop)
    local_ids = torch.where(inside, ids - start, 0)
    pad = padding_idx - start if start <= padding_idx < stop else -1
    rows = torch.ops.aten.embedding.default(weight, local_ids, pad)
    return rows * inside.unsqueeze(-1).to(rows.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, class_dim, start, stop, reduction, ignore_index, group):
        x = logits.movedim(class_dim, -1)
        peak = x.detach().amax(-1)
        peak = plain_all_reduce(peak, group, "max")
        shifted = x - peak.unsqueeze(-1)
        valid = target != ignore_index
        inside = (target >= start) & (target < stop) & valid
        local_t = torch.where(inside, target - start, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside
        sums = plain_all_reduce(torch.stack([shifted.exp().sum(-1), picked]), group)
        log_z = sums[0].log()
        losses = (log_z - sums[1]) * valid
        ctx.save_for_backward(shifted, log_z, local_t, inside, valid)
        ctx.class_dim, ctx.reduction = class_dim, reduction
        if reduction == MEAN:
            return losses.sum() / valid.sum()
        return losses.sum() if reduction == SUM else losses

    @staticmethod
    def backward(ctx, grad):
        shifted, log_z, local_t, inside, valid = ctx.saved_tensors
        g = (shifted - log_z.unsqueeze(-1)).exp()  # this rank's slice of the softmax
        g = g.scatter_add(-1, local_t.unsqueeze(-1), -inside.unsqueeze(-1).to(g.dtype))
        scale = valid.to(g.dtype) * (grad / valid.sum() if ctx.reduction == MEAN else grad)
        g = g * scale.unsqueeze(-1)
        return g.movedim(-1, ctx.class_dim), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, class_dim: int, start: int, stop: int,
                                 reduction: int = MEAN, ignore_index: int = -100,
                                 group: str = "0", vocab: int | None = None) -> torch.Tensor:
    """Cross-entropy of logits whose ``class_dim`` holds vocabulary ``[start, stop)`` here.

    Same semantics as ``aten.cross_entropy_loss`` without class weights or label smoothing;
    the result is replicated (every rank gets the full loss). ``vocab``: the whole vocabulary,
    to refuse targets no rank holds (see :func:`check_ids`).
    """
    check_ids(target, vocab, "vocabulary-parallel cross-entropy targets", ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, class_dim, start, stop, reduction,
                                            ignore_index, group)


# the max and the (sum of exps, target logit) pair: two all-reduces forward, none backward
COLLECTIVE_FNS[vocab_parallel_cross_entropy] = (("all_reduce", "all_reduce"), ())


def sharded_cross_entropy(tp, local_logits: torch.Tensor, target: torch.Tensor,
                          ignore_index: int = -100, reduction: str = "mean",
                          output_index: int = 0) -> torch.Tensor:
    """Cross-entropy of a ``loss_parallel`` module's sharded logits, like ``F.cross_entropy``.

    ``local_logits`` is this rank's shard of output ``output_index`` of ``tp`` (built with
    ``parallelize(..., loss_parallel=True)``), shaped ``(..., vocab_shard)``; ``target`` has the
    leading shape. The full logits are never gathered.
    """
    layout = tp.plan.output_layouts().get(output_index)
    if layout is None:
        return torch.nn.functional.cross_entropy(
            local_logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index,
            reduction=reduction)
    (start, stop), = tp.plan.specs.ranges(layout)[tp.rank]
    codes = {"mean": MEAN, "sum": SUM, "none": 0}
    return vocab_parallel_cross_entropy(local_logits.flatten(0, -2), target.flatten(), 1, start, stop,
                                        codes[reduction], ignore_index, tp.group.group_name,
                                        layout.size)
