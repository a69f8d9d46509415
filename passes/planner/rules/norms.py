"""Layer, RMS and group norms: per-token (per-group) statistics over the features they normalise.

A shard of a dim the norm keeps passes (heads cut, head_dim normalised whole). ``rms_norm``
over a column-parallel projection's own features (Wan's and LTX's q / k norms over every head
at once, ``nn.RMSNorm(heads * head_dim)``) is not gathered: the node is planned again through
its decomposition into a mean of squares, whose partial sums are a per-token statistic
all-reduced where it is read (``mean``'s rule in :mod:`.reductions`): one number per token
instead of the features. The decomposition computes as ATen's kernel does (float32 for half
inputs, the weight applied after the cast back). ``layer_norm`` over cut features gathers
them: its decomposition's gradients drift past the 1e-5 bar in float32.

``native_group_norm`` splits the channels into groups and normalises each group alone: a
channel shard whose every rank holds whole groups passes (each rank normalises its own
groups, ``C`` and ``group`` rewritten to its share); a cut through a group gathers.
"""

from __future__ import annotations

import torch

from tpcompile.core.placement import Shard
from tpcompile.passes.planner.dims import shape, split_layout
from tpcompile.passes.planner.rules.einsum import einsum_rule, replicate_all, tensor_args
from tpcompile.passes.planner.rules.reductions import last_dims_free
from tpcompile.passes.planner.rules.table import register

aten = torch.ops.aten


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _rms_norm_as_mean(x, normalized_shape, weight=None, eps=None):
    """``aten.rms_norm`` as its kernel computes it, the mean of squares a ``mean``."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    up = x.to(_compute_dtype(x))
    eps = torch.finfo(up.dtype).eps if eps is None else eps
    out = (up * torch.rsqrt(torch.mean(up * up, dims, keepdim=True) + eps)).to(x.dtype)
    return out if weight is None else out * weight


def _normalized(node, n: int) -> set[int]:
    return set(range(n - len(node.args[1]), n))


_reads_normalized_whole = last_dims_free(_normalized)


def _rms_norm(op):
    """``rms_norm(x, normalized_shape, weight, eps)``: the last ``len(normalized_shape)`` dims
    read whole per token, the weight cut with them (``layer_norm`` likewise). Over a
    column-parallel projection's own output features (through views and casts), planned again
    through the decomposition; over a sum the cut joined (a residual stream, which no settled
    plan keeps cut: ``dead_chains``) gathered, so that no trial round leaves the norm running
    as separate kernels for nothing."""
    x = op.node.args[0]
    p = op.placement(x)
    if (isinstance(p, Shard) and p.dim in _normalized(op.node, len(shape(x)))
            and not op.specs.is_full(p.layout) and op.projected(x, p.layout)):
        op.decompose(f"{op.node.name} normalises over the sharded dim {p.dim}")
    return _reads_normalized_whole(op)


register(aten.rms_norm.default, decomposition=_rms_norm_as_mean)(_rms_norm)
register(aten.layer_norm.default)(last_dims_free(_normalized))


def _group_norm(op):
    """``native_group_norm(x, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)``: a
    channel shard of whole groups passes to the output (weight and bias cut alike) and to the
    per-group statistics ``(N, group)``; a cut through a group asks its root for whole groups
    (:class:`Misaligned`), as a view into heads does. Every other shard is gathered: the
    statistics read all the spatial positions."""
    x, channels, group = op.node.args[0], op.node.args[4], op.node.args[6]
    n = len(shape(x))
    p = op.placement(x)
    if not (isinstance(p, Shard) and p.dim == 1 and isinstance(channels, int)):
        return [replicate_all(op)] * 3
    groups = split_layout(p.layout, group, channels // group)
    op.check_aligned(groups)
    operands = [(x, [0, "c"] + [f"s{d}" for d in range(2, n)])]
    operands += [(a, ["c"]) for a in tensor_args(op.node)[1:]]
    out = einsum_rule(op, operands, [0, "c"] + [f"s{d}" for d in range(2, n)])
    stats = Shard(1, groups) if isinstance(out, Shard) else out
    return [out, stats, stats]


def _localize_group_norm(node, local):
    """The rank's channels and groups: ``C`` and ``group`` its share of them."""
    (p, _, _) = local.out_placements(node)
    if isinstance(p, Shard) and p.dim == 1:
        channels, mine = node.args[4], local.local_size(p)
        local.set_arg(node, 6, node.args[6] * mine // channels)
        local.set_arg(node, 4, mine)


register(aten.native_group_norm.default, localize=_localize_group_norm)(_group_norm)
