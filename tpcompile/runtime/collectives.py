"""The collectives a rewritten graph calls: Megatron's conjugate operator pairs.

Each is a ``torch.autograd.Function`` around ``torch.ops._c10d_functional`` ops, so it runs
eagerly on any ``torch.distributed`` backend and traces into inductor under ``torch.compile``
(``fullgraph=True``) as plain functional collectives.

The backward of each is chosen for tensor parallelism's gradient convention, not as the
mathematical adjoint: a replicated value's gradient is *whole* on every rank (every rank
computes the same replicated loss). Hence ``all_reduce``'s backward is the identity (Megatron
*g*) and ``copy_into_chain``'s backward is an all-reduce (Megatron *f*); plain
``funcol.all_reduce`` would all-reduce both ways and multiply gradients by the world size.
"""

from __future__ import annotations

import torch

from tpcompile.errors import CollectiveError
from tpcompile.runtime.backward_reach import backward_nodes
from tpcompile.runtime.timeouts import collective_failure

__all__ = ["all_reduce", "plain_all_reduce", "zero_summand", "copy_into_chain", "copy_all_into_chain", "sync_grad_pieces", "all_gather", "gather_into_chain",
           "reduce_scatter",
           "COLLECTIVE_FNS", "count_collectives", "issued"]

_c10d = torch.ops._c10d_functional


def _waited(what: str, group: str, launch) -> torch.Tensor:
    """Launch one functional collective and wait for it; a backend failure (a rank that exited
    or timed out) becomes a :class:`CollectiveError` naming the collective and the cause."""
    if torch.compiler.is_compiling():  # traced into the graph: failures surface at run time
        return _c10d.wait_tensor(launch())
    try:
        return _c10d.wait_tensor(launch())
    except CollectiveError:
        raise
    except RuntimeError as e:
        raise collective_failure(what, group, e) from e


def plain_all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """``x`` reduced over ``group`` by ``op``, with no autograd of its own (:func:`all_reduce`
    is Megatron's *g*)."""
    return _waited("all_reduce", group, lambda: _c10d.all_reduce(x.contiguous(), op, group))


class _AllReduce(torch.autograd.Function):
    """g: forward sums the ranks' partial results; backward passes the whole gradient through."""

    @staticmethod
    def forward(ctx, x, group):
        return plain_all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyIntoChain(torch.autograd.Function):
    """f: forward identity into a sharded chain; backward sums the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return plain_all_reduce(grad, ctx.group), None


def _all_reduce_together(tensors: list, group: str) -> list:
    """Sum each tensor over the ranks in one all-reduce of them all, flattened."""
    summed = plain_all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    return [s.view_as(t) for s, t in zip(summed.split([t.numel() for t in tensors]), tensors)]


class _CopyAllIntoChain(torch.autograd.Function):
    """f for several values at once (a block's replicated k and v): their gradients' partial
    sums are reduced in one all-reduce."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_all_reduce_together(list(grads), ctx.group))


class _SyncGradPieces(torch.autograd.Function):
    """f for weights with replicated blocks: only those rows' gradients are partial sums. The
    pieces of several weights (a block's replicated wk and wv) go in one all-reduce."""

    @staticmethod
    def forward(ctx, dims, pieces, group, *weights):
        ctx.dims, ctx.pieces, ctx.group = dims, pieces, group
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        parts = [g.narrow(dim, s, e - s) for g, dim, pieces in zip(grads, ctx.dims, ctx.pieces)
                 for s, e in pieces]
        summed = iter(_all_reduce_together(parts, ctx.group))
        out = []
        for g, dim, pieces in zip(grads, ctx.dims, ctx.pieces):
            kept, pos = [], 0
            for s, e in pieces:
                kept += [g.narrow(dim, pos, s - pos), next(summed)]
                pos = e
            kept.append(g.narrow(dim, pos, g.shape[dim] - pos))
            out.append(torch.cat(kept, dim))
        return (None, None, None, *out)


class _ZeroSummand(torch.autograd.Function):
    """Replicate -> Partial: rank 0's share is the value, every other rank's zeros. The
    partial sum's gradient is whole on every rank (the all-reduce that ends it passes it
    through), and so is the replicated value's: backward is the identity on every rank."""

    @staticmethod
    def forward(ctx, x, keep):
        return x.view_as(x) if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Partial -> Replicate (Megatron g)."""
    return _AllReduce.apply(x, group)


def zero_summand(x: torch.Tensor, keep: bool) -> torch.Tensor:
    """Replicate -> Partial with no communication: ``x`` on the rank that ``keep``s it (rank
    0), zeros on the others, so the ranks' values sum to ``x``; the gradient passes through
    whole on every rank (a carried sum: ``passes/planner/refine/carried_sums.py``)."""
    return _ZeroSummand.apply(x, keep)


def copy_all_into_chain(xs: list, group: str) -> tuple:
    """Several replicated values entering sharded chains: one gradient all-reduce for all."""
    return _CopyAllIntoChain.apply(group, *xs)


def copy_into_chain(x: torch.Tensor, group: str) -> torch.Tensor:
    """Replicate value entering a sharded chain (Megatron f)."""
    return _CopyIntoChain.apply(x, group)


def sync_grad_pieces(weights: list, dims: list, pieces: list, group: str) -> tuple:
    """Weights whose ``pieces`` along ``dims`` are replicated on every rank inside a chain:
    their gradients' pieces are summed over the ranks in one all-reduce."""
    return _SyncGradPieces.apply(dims, pieces, group, *weights)


def _gather(x: torch.Tensor, dim: int, width: int, index, group_size: int, group: str):
    """All-gather shards along ``dim`` (zero-padded to ``width``) and put them in global order."""
    moved = x.movedim(dim, 0)
    if moved.shape[0] < width:
        pad = moved.new_zeros((width - moved.shape[0],) + tuple(moved.shape[1:]))
        moved = torch.cat([moved, pad])
    out = _waited("all_gather", group,
                  lambda: _c10d.all_gather_into_tensor(moved.contiguous(), group_size, group))
    if index is not None:
        out = out.index_select(0, torch.tensor(index, device=out.device))
    return out.movedim(0, dim)


def _take(x: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """The given global ranges of ``dim``, concatenated."""
    parts = [x.narrow(dim, s, e - s) for s, e in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _own_slice(grad: torch.Tensor, dim: int, mine, keep) -> torch.Tensor:
    """This rank's ``mine`` ranges of a whole gradient; where ranks overlap only one keeps it."""
    local = _take(grad, dim, mine)
    if keep is not None:
        shape = [1] * local.dim()
        shape[dim] = -1
        local = local * torch.tensor(keep, device=grad.device, dtype=grad.dtype).view(shape)
    return local


def _sum_own_slice(grad: torch.Tensor, dim: int, index, mine, keep, group_size: int,
                   group: str) -> torch.Tensor:
    """This rank's slice of the ranks' summed ``grad``: one reduce-scatter when the shards are
    even, contiguous and disjoint (``index`` and ``keep`` None), else an all-reduce and the
    slice (what :func:`issued` reports for such a call)."""
    if index is None and keep is None:
        moved = grad.movedim(dim, 0).contiguous()
        out = _waited("reduce_scatter", group, lambda: _c10d.reduce_scatter_tensor(
            moved, "sum", group_size, group))
        return out.movedim(0, dim)
    return _own_slice(plain_all_reduce(grad, group), dim, mine, keep)


class _Gather(torch.autograd.Function):
    """Shard -> Replicate. Backward keeps this rank's slice of the whole gradient; when the
    result feeds a sharded chain (``sum_grads``) the gradient is a per-rank partial sum, so it
    is summed first (a reduce-scatter: Megatron-SP's all-gather)."""

    @staticmethod
    def forward(ctx, x, dim, width, index, mine, keep, group_size, group, sum_grads):
        ctx.dim, ctx.mine, ctx.keep, ctx.group, ctx.sum_grads = dim, mine, keep, group, sum_grads
        ctx.index, ctx.group_size = index, group_size
        return _gather(x, dim, width, index, group_size, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grads:
            return (_sum_own_slice(grad, ctx.dim, ctx.index, ctx.mine, ctx.keep,
                                   ctx.group_size, ctx.group),) + (None,) * 8
        return (_own_slice(grad, ctx.dim, ctx.mine, ctx.keep),) + (None,) * 8


class _ReduceScatter(torch.autograd.Function):
    """Partial -> Shard; backward all-gathers the shards' gradients (the whole gradient)."""

    @staticmethod
    def forward(ctx, x, dim, width, index, mine, group_size, group):
        ctx.args = (dim, width, index, group_size, group)
        if index is None:  # even, contiguous shards: a real reduce-scatter (half the bytes)
            moved = x.movedim(dim, 0).contiguous()
            out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(moved, "sum", group_size, group))
            return out.movedim(0, dim)
        # a fresh tensor, not a view: a view would keep the whole sum alive when saved
        return _take(plain_all_reduce(x, group), dim, mine).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, *ctx.args), None, None, None, None, None, None


def all_gather(x: torch.Tensor, dim: int, width: int, index, mine, keep, group_size: int,
               group: str) -> torch.Tensor:
    """Shard -> Replicate along ``dim``.

    ``width``: the largest local size (shards are zero-padded to it for the collective).
    ``index``: global position -> position in the rank-major gathered buffer; None when the
    shards are even, contiguous and disjoint. ``mine``: this rank's global ranges (its
    backward slice). ``keep``: 0/1 per local position, so that an index held by several ranks
    gets its gradient once; None when no index is shared.
    """
    return _Gather.apply(x, dim, width, index, mine, keep, group_size, group, False)


def gather_into_chain(x: torch.Tensor, dim: int, width: int, index, mine, keep, group_size: int,
                       group: str) -> torch.Tensor:
    """:func:`all_gather` whose result feeds a sharded chain (gradients summed on the way back)."""
    return _Gather.apply(x, dim, width, index, mine, keep, group_size, group, True)


def reduce_scatter(x: torch.Tensor, dim: int, width: int, index, mine, group_size: int,
                   group: str) -> torch.Tensor:
    """Partial -> Shard along ``dim`` (arguments as for :func:`all_gather`)."""
    return _ReduceScatter.apply(x, dim, width, index, mine, group_size, group)


# what each inserted call costs: (forward collectives, backward collectives); modules with
# other communicating ops (tpcompile.runtime.vocab) register theirs here too
COLLECTIVE_FNS = {
    all_reduce: (("all_reduce",), ()),
    plain_all_reduce: (("all_reduce",), ()),  # a max / min partial's (no gradient flows)
    copy_into_chain: ((), ("all_reduce",)),
    copy_all_into_chain: ((), ("all_reduce",)),
    sync_grad_pieces: ((), ("all_reduce",)),
    all_gather: (("all_gather",), ()),
    gather_into_chain: (("all_gather",), ("reduce_scatter",)),
    reduce_scatter: (("reduce_scatter",), ("all_gather",)),
}


def issued(node, backward: set) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forward, backward) collectives one inserted call issues. ``backward``: the graph's
    nodes its backward reaches (:func:`~tpcompile.runtime.backward_reach.backward_nodes`); a
    call outside it issues no backward collective. A reduce-scatter over uneven or reordered
    shards (an ``index``, the calls' fourth argument) runs as an all-reduce and the rank's
    slice, so it is reported as one."""
    forward, back = COLLECTIVE_FNS[node.target]
    phases = (forward, back if node in backward else ())
    if node.target in _SCATTERS_BY_INDEX and node.args[3] is not None:
        phases = tuple(tuple("all_reduce" if k == "reduce_scatter" else k for k in kinds)
                       for kinds in phases)
    return phases


def count_collectives(gm) -> dict[str, dict[str, int]]:
    """Collectives one forward and one backward of a rewritten graph issue, by kind (the
    backward of every floating output; gradient syncs it never reaches are not counted)."""
    counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    reached = backward_nodes(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVE_FNS:
            for phase, kinds in zip(("forward", "backward"), issued(node, reached)):
                for kind in kinds:
                    counts[phase][kind] = counts[phase].get(kind, 0) + 1
    return counts


class _GatheredLinears(torch.autograd.Function):
    """Megatron-SP's column-parallel input: gather sequence shards, apply several linears,
    and save only the shard for backward (the gather is redone there), so the replicated
    input never sits in activation memory. Backward: dx is reduce-scattered back to shards."""

    @staticmethod
    def forward(ctx, x, dim, width, index, mine, keep, group_size, group, *weights_and_biases):
        full = _gather(x, dim, width, index, group_size, group)
        pairs = list(zip(weights_and_biases[0::2], weights_and_biases[1::2]))
        ctx.args = (dim, width, index, mine, keep, group_size, group)
        ctx.has_bias = [b is not None for _, b in pairs]
        ctx.save_for_backward(x, *[w for w, _ in pairs])
        # the bias out of place: linear(x, w, b) returns a view, and a view returned by a
        # Function may not be written in place (ReLU(inplace=True) on it would be refused)
        return tuple(_linear(full, w, b) for w, b in pairs)

    @staticmethod
    def backward(ctx, *grads):
        dim, width, index, mine, keep, group_size, group = ctx.args
        x, *weights = ctx.saved_tensors
        full = _gather(x, dim, width, index, group_size, group)
        flat = full.reshape(-1, full.shape[-1])
        dx, out = None, []
        for w, g, has_bias in zip(weights, grads, ctx.has_bias):
            g2 = g.reshape(-1, g.shape[-1])
            dx = g @ w if dx is None else dx + g @ w
            out += [g2.t() @ flat, g2.sum(0) if has_bias else None]
        local = _sum_own_slice(dx, dim, index, mine, keep, group_size, group)
        return (local, None, None, None, None, None, None, None, *out)


def _linear(x, w, b):
    y = torch.nn.functional.linear(x, w)
    return y if b is None else y + b


def gathered_linears(x, dim, width, index, mine, keep, group_size, group, *weights_and_biases):
    """``[linear(all_gather(x), w, b) for w, b]`` saving only ``x`` (see _GatheredLinears)."""
    return _GatheredLinears.apply(x, dim, width, index, mine, keep, group_size, group,
                                  *weights_and_biases)


COLLECTIVE_FNS[gathered_linears] = (("all_gather",), ("all_gather", "reduce_scatter"))
# calls whose reduce-scatter is an all-reduce when their shards carry an index (see issued)
_SCATTERS_BY_INDEX = {reduce_scatter, gather_into_chain, gathered_linears}
