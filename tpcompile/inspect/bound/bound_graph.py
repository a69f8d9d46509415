"""The facts of a captured graph that Megatron's bound (:mod:`tpcompile.inspect.bound.bound`) reads.

Per matmul with a stored operand: its weights, its activation, its features, the matmuls it
reads from and feeds within its block (through any op but another matmul), whether it picks
experts (a router), whether it is one factor of a low-rank pair, the heads its output is viewed
as, and the statistics taken over all of its output features. And two walks the collective
counts need: how far a partial sum stays a sum (``reach_forward``), and where the partial
gradient of a column-parallel input may be summed (``reduce_points``). Nothing here looks at
a plan; the op sets below are the oracle's own (which ops keep a sum a sum, cut a value into
pieces, keep features apart, reduce over features), written apart from the rule table so that
the bound does not inherit a rule's mistake.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import networkx as nx
import torch
from torch import fx

from tpcompile.core.block_paths import block_path
from tpcompile.core.capture import Capture, concrete_shape, module_path
from tpcompile.passes.planner.rules.quantized import stored_inputs
from tpcompile.passes.planner.rules import is_param_matmul
from tpcompile.passes.planner.rules.table import is_attention, is_view
from tpcompile.passes.planner.rules.writes import any_placement

__all__ = ["Matmul", "computed_from", "differentiable", "find_matmuls", "grad_carriers", "is_product", "layer_of",
           "reach_forward", "reduce_points", "sizes", "value_bytes", "value_users"]

aten = torch.ops.aten
# ops linear in a partial sum: it stays a sum of the ranks' pieces through them
_SUMS = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.mul.Tensor,
         aten.div.Tensor,
         aten.neg.default, aten.index.Tensor, aten.index_add.default, aten.index_put.default,
         aten.scatter_add.default, aten._to_copy.default, aten.to.dtype, aten.type_as.default,
         aten.clone.default,
         aten.sum.dim_IntList, aten.dropout.default}
# ops that join partial sums into one (each expert's rows of a looped MoE's output): still a sum
_JOINS = {aten.cat.default, aten.vstack.default, aten.hstack.default}
# ops that cut a value into pieces (a split's pieces are its getitems)
_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default,
           aten.unbind.int}
_PIECES = {aten.slice.Tensor, aten.index.Tensor, aten.narrow.default, aten.select.int}
# ops that keep each feature its own: activations and casts
_UNARY = {aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default,
          aten.tanh.default, aten.to.dtype, aten._to_copy.default, aten.clone.default}
# ops that only look at a value (export's dtype and device checks): no use of it
_CHECKS = {aten._assert_tensor_metadata.default}
# matmuls of two values (:func:`is_product`)
_PRODUCTS = {aten.einsum.default, aten.bmm.default, aten.matmul.default, aten.mm.default}
_SINK = "sink"  # where reduce_points' paths end
_SIZES = (torch.SymInt, torch.SymFloat, int, float)  # a size read's value
# extrema, and the ops through which an extremum stays one (rules/extrema.py plans alike)
_EXTREMA = {aten.amax.default, aten.amin.default}
_KEEP_EXTREMA = {aten.maximum.default, aten.minimum.default, aten.neg.default}
_STATISTICS = {aten.mean.dim, aten.sum.dim_IntList, aten.var.correction,
               aten.linalg_vector_norm.default, aten.amax.default, aten.amin.default}
# ATen's fused norms: their statistics inside, over the features they keep
_NORMS = {aten.rms_norm.default, aten.layer_norm.default}


@dataclass
class Matmul:
    node: fx.Node
    weights: list            # the weight operand's largest stored tensor (not its scales)
    biases: list             # targets of the other stored operands
    activation: fx.Node | None
    in_features: int
    out_features: int
    upstream: list = field(default_factory=list)    # nearest matmuls it reads from
    downstream: list = field(default_factory=list)  # nearest matmuls reading it
    router: bool = False     # its output reaches topk
    up: fx.Node | None = None      # set on a down factor: its up factor
    up_of: fx.Node | None = None   # set on an up factor: its down factor
    heads: int | None = None
    statistics: tuple = ()
    parts: tuple = ()        # (features, heads) of the pieces its output is cut into


def sizes(node: fx.Node) -> list[int | None]:
    """Its value's sizes at the example's inputs; None for a size with no example value."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return [None]
    return [s if isinstance(s, int) else None for s in concrete_shape(v)]


def _numel(node: fx.Node) -> int | None:
    dims = sizes(node)
    return None if None in dims else math.prod(dims)


def value_bytes(node: fx.Node) -> int:
    """The bytes of ``node``'s value at the example's sizes (0 without one)."""
    n, v = _numel(node), node.meta.get("val")
    return n * v.dtype.itemsize if n is not None and isinstance(v, torch.Tensor) else 0


def _last(node: fx.Node) -> int | None:
    dims = sizes(node)
    return dims[-1] if dims else 1


def _matmul(node: fx.Node) -> Matmul | None:
    """``node`` as a matmul of a stored weight; None when no operand is stored."""
    stored, acts = [], []
    for arg in node.all_input_nodes:
        found = stored_inputs(arg)
        (stored if found is not None and found[0] else acts).append((arg, found))
    if not stored or not acts or node.meta.get("val") is None:
        return None
    stored.sort(key=lambda s: -max(_numel(leaf) or 0 for leaf in s[1][0]))
    act = acts[0][0]
    in_f, out_numel, act_numel = _last(act), _numel(node), _numel(act)
    # features per token: the einsum "bld,dhk->blhk" makes h * k of them
    out_f = out_numel * in_f // act_numel if out_numel and act_numel else _last(node)
    weight = max(stored[0][1][0], key=lambda leaf: _numel(leaf) or 0)
    return Matmul(node, [weight.target],
                  [leaf.target for _, f in stored[1:] for leaf in f[0]], act, in_f, out_f)


def layer_of(node: fx.Node) -> str:
    return block_path(module_path(node))


def _nearest(m: Matmul, by_node: dict, layer: str, up: bool) -> list[fx.Node]:
    """The matmuls of ``layer`` ``m`` reads from (``up``) or feeds, through any other op."""
    found, seen = [], set()
    todo = [m.activation] if up else list(m.node.users)
    while todo:
        n = todo.pop()
        if n in seen or n.op in ("placeholder", "get_attr", "output") or layer_of(n) != layer:
            continue
        seen.add(n)
        other = by_node.get(n)
        if other is not None:
            found.append(n)
            continue
        if up and _statistic(n):
            continue  # whole after its all-reduce: a per-token scale reads no cut onward
        # a size read (``sym_size`` of another value, for a view's shape) carries no data
        todo.extend([a for a in n.all_input_nodes if not isinstance(a.meta.get("val"), _SIZES)]
                    if up else n.users)
    return found


def _reaches(node: fx.Node, layer: str, by_node: dict, target) -> bool:
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n in seen or n in by_node or n.op == "output" or layer_of(n) != layer:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is target:
            return True
        todo.extend(n.users)
    return False


def _heads(node: fx.Node, features: int, rank: int) -> int | None:
    """The heads ``node``'s ``features`` are viewed as: a view whose trailing dims (heads,
    head_dim) multiply to them, reached through views and same-shape sums and scalings (a LoRA
    factor's output added to its base's, a cast); None when they are never viewed so. The
    heads are every trailing dim but head_dim: torchtitan's fused qkv piece is (kv heads, 1,
    head_dim). A view into heads has more dims than the matmul's output (``rank``): the 1
    before the features of a ``(B * H * W, 1, F)`` output is a token dim (a temporal
    transformer over one frame), not one head."""
    todo = [node]
    while todo:
        n = todo.pop()
        dims = sizes(n)
        for k in range(len(dims) - 2, 0, -1) if len(dims) > rank else ():
            if None not in dims[k:] and math.prod(dims[k:]) == features:
                return math.prod(dims[k:-1])
        todo.extend(u for u in n.users if is_view(u) or (
            u.target in _SUMS and sizes(u) == dims))
    return None


def _is_piece(n: fx.Node) -> bool:
    """A cut of a value into pieces; not a cut of the last dim of a value viewed per head
    (rotary's halves of each head's features)."""
    src = n.args[0] if n.target in _PIECES else getattr(n.args[0], "args", (None,))[0] \
        if n.target is operator.getitem else None
    if not isinstance(src, fx.Node) or not (n.target in _PIECES or getattr(
            n.args[0], "target", None) in _SPLITS):
        return False
    cut = n.args[0] if n.target is operator.getitem else n
    dims = sizes(src)
    at = 2 if cut.target in (aten.split_with_sizes.default, aten.split.Tensor,
                             aten.chunk.default) else 1  # where the op takes its dim
    dim = cut.args[at] if len(cut.args) > at and cut.target is not aten.index.Tensor else 0
    return not (len(dims) >= 4 and isinstance(dim, int) and dim % len(dims) == len(dims) - 1)


def _bias_add(n: fx.Node) -> bool:
    """An add of a stored tensor (a bias added after the matmul, ``nn.MultiheadAttention``)."""
    return n.target is aten.add.Tensor and any(
        (found := stored_inputs(a)) is not None and found[0] for a in n.all_input_nodes)


def _channelwise(n: fx.Node) -> bool:
    """An op that keeps each feature its own: an activation or a cast, or a depthwise conv
    (Mamba's conv1d over xBC, groups = channels)."""
    if n.target in _UNARY:
        return True
    return n.target is aten.conv1d.default and len(n.args) > 6 and \
        n.args[6] == sizes(n.args[0])[1]


def _parts(m: Matmul, node: fx.Node, features: int) -> tuple[tuple[int, int | None], ...]:
    """The pieces ``node`` (``m``'s output, ``features`` wide, or a piece of it) is cut into,
    reached through views (and, inside a piece, channelwise ops): a fused qkv's q, k and v by
    ``split``, by slices of its head dim or by list indices (Falcon's ``qkv[..., [-2], :]``);
    Mamba-2's B / C, cut from xBC after its depthwise conv1d. Each as (features, heads it is
    viewed as), a piece never viewed as heads replaced by its own pieces if it has any; empty
    when no op cuts ``node``. Whole rows of a fused weight are read from these (``bound``)."""
    act = _numel(m.activation)
    out, seen, todo = [], set(), list(node.users)
    while todo and act:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        f = (_numel(n) or 0) * m.in_features // act
        if _is_piece(n) and 0 < f < features:
            heads = _heads(n, f, len(sizes(m.node)))
            out += [(f, heads)] if heads is not None else list(_parts(m, n, f)) or [(f, None)]
        elif _is_piece(n) or n.target in _SPLITS or is_view(n) or (
                node is not m.node and _channelwise(n)) or (
                f == features and (n.target is aten.contiguous.default or _bias_add(n))):
            todo.extend(n.users)
    return tuple(out)


def _statistic(n: fx.Node) -> bool:
    """A reduction over the features of its input (a norm's mean, a quantization's max)."""
    return n.target in _STATISTICS and _last(n) != _last(n.args[0])


def _statistics(m: Matmul) -> tuple[fx.Node, ...]:
    """Reductions over every output feature of ``m`` or of one of its pieces (a norm over the
    whole projection, not per head, ATen's fused ``rms_norm`` / ``layer_norm`` included; Mamba-2's gated norm over its z piece), reached through
    views, pieces and elementwise ops, and from a value through attention to a norm over all
    its heads' outputs (BitNet's ``attn_sub_norm`` before ``o_proj``)."""
    widths = {m.out_features} | {f for f, _ in m.parts}
    out, seen, todo = [], set(), list(m.node.users)
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if ((n.target in _STATISTICS and _last(n) != _last(n.args[0]))
                or n.target in _NORMS) and _last(n.args[0]) in widths:
            out.append(n)
        elif is_view(n) or n.target in _SUMS | _SPLITS | _UNARY or _is_piece(n) \
                or n.target is aten.pow.Tensor_Scalar or _value_operand(n) is not None:
            if _value_operand(n) is not None and len(dims := sizes(n)) == 4:
                widths.add((dims[1] or 0) * (dims[3] or 0))  # (B, heads, T, D) -> heads x D
            # attention's output is cut by heads from its value or its query (whole kv heads
            # under GQA with fewer kv heads than ranks)
            todo.extend(u for u in n.users if _value_operand(u) in (None, n)
                        or (is_attention(u) and u.args[0] is n))
    return tuple(_one_per_meeting(out))


def _one_per_meeting(stats: list[fx.Node]) -> list[fx.Node]:
    """The statistics, extrema whose results meet through ``maximum`` / ``minimum`` / ``neg``
    before any other use counted once (a symmetric quantization scale: ``max(-min(amin, 0),
    max(amax, 0))``, the largest magnitude: one all-reduce by max); a min and a max used
    apart (an asymmetric scale and zero point) are two."""
    out, met = [], []
    for n in sorted(stats, key=lambda n: n.name):  # one representative, whatever walk found it
        reach = _extremum_reach(n) if n.target in _EXTREMA else set()
        if reach & set().union(*met):
            continue
        out.append(n)
        met.append(reach)
    return out


def _extremum_reach(node: fx.Node) -> set:
    """The ops an extremum passes through as an extremum (``maximum`` of it and zeros...)."""
    seen, todo = set(), [u for u in node.users if u.target in _KEEP_EXTREMA]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(u for u in n.users if u.target in _KEEP_EXTREMA)
    return seen


def _value_operand(n: fx.Node) -> fx.Node | None:
    """The operand whose features attention carries, per head, to its output: the value of
    ``scaled_dot_product_attention`` or of ``weights @ v`` (a matmul of two computed values);
    None for any other op."""
    if is_attention(n):
        return n.args[2]
    if n.target in (aten.matmul.default, aten.bmm.default) and len(n.args) > 1 and not any(
            stored_inputs(a) is not None for a in n.all_input_nodes):
        return n.args[1]
    return None


def find_matmuls(cap: Capture, low_rank: int) -> list[Matmul]:
    """Every matmul of a stored weight in ``cap``'s graph, in graph order, with its links."""
    mms = [m for n in cap.gm.graph.nodes if is_param_matmul(n) for m in [_matmul(n)] if m]
    by_node = {m.node: m for m in mms}
    for m in mms:
        layer = layer_of(m.node)
        m.downstream = _nearest(m, by_node, layer, up=False)
        m.router = _reaches(m.node, layer, by_node, aten.topk.default)
        m.heads = _heads(m.node, m.out_features, len(sizes(m.node)))
        m.parts = _parts(m, m.node, m.out_features)
        m.statistics = _statistics(m)
    for m in mms:  # pair low-rank factors before the upstream walk passes through them
        if not (m.out_features and m.in_features) or m.router or m.up_of is not None:
            continue
        up = next((u for d in m.downstream for u in [by_node[d]] if u.up_of is None
                   and (u.in_features or m.out_features + 1) <= m.out_features
                   and _low_rank(m, u, low_rank)), None)
        if up is not None:
            m.up, up.up_of = up.node, m.node
    for m in mms:
        m.upstream = _through_down(m, by_node)
    return mms


def _low_rank(down: Matmul, up: Matmul, low_rank: int) -> bool:
    """``down`` -> ``up`` is a low-rank pair: ``up`` reads ``down``'s output and stored tensors
    alone, and ``down`` narrows its input ``low_rank`` times (a LoRA adapter, MLA at DeepSeek's
    widths), or its output is normalized whole on the way and ``up`` expands that latent
    ``low_rank`` times into heads (MLA whose latent is not narrower than the model:
    torchtitan's DeepSeek-V3 debug config, 256 -> 576 -> 16 heads of 256)."""
    narrows = down.out_features * low_rank <= down.in_features
    if not (narrows or (up.heads and up.out_features >= low_rank * up.in_features)):
        return False
    path = _made_from(up.activation, down.node)
    return path is not None and (narrows or bool(set(down.statistics) & path))


def _made_from(node: fx.Node | None, source: fx.Node) -> set[fx.Node] | None:
    """The nodes ``node`` is computed from back to ``source`` when that is ``source`` and
    stored tensors alone (a LoRA factor's output scaled, MLA's latent through its norm); None
    when another activation joins it, as the block's residual stream does between a narrow
    output projection and the next block's matmuls."""
    seen, todo, layer = set(), [node], layer_of(source)
    while todo:
        n = todo.pop()
        if n is None or n.op == "placeholder" or (n.op == "call_function" and layer_of(n) != layer):
            return None
        if n is source or n in seen or stored_inputs(n) is not None:
            continue
        seen.add(n)  # values only: a view's symbolic sizes come from the inputs' shapes
        todo.extend(a for a in n.all_input_nodes if _data(a.meta.get("val")))
    return seen


def _through_down(m: Matmul, by_node: dict) -> list[fx.Node]:
    """``m``'s nearest upstream matmuls, a down factor replaced by what it reads from."""
    out, layer = [], layer_of(m.node)
    for n in _nearest(m, by_node, layer, up=True):
        down = by_node[n]
        out += _through_down(down, by_node) if down.up is not None else [n]
    return out


def value_users(node: fx.Node) -> list[fx.Node]:
    """The users that read ``node``'s values: not a fresh buffer shaped like it
    (``new_zeros(n, ...)``), nor export's dtype and device checks."""
    return [u for u in node.users if not any_placement(u) and u.target not in _CHECKS]


def reach_forward(node: fx.Node, layer: str, carriers: set) -> set[fx.Node]:
    """The values a partial sum from ``node`` reaches while every use of it keeps it a sum
    (``carriers``: whole matmuls, linear in their input): where sums of two rowwise matmuls
    meet, one all-reduce serves both."""
    reach, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in reach:
            continue
        reach.add(n)
        users = value_users(n)
        if all(u.op == "call_function" and layer_of(u) == layer
               and (u in carriers or u.target in _SUMS | _JOINS or is_view(u) or is_product(u))
               for u in users):
            todo.extend(users)
    return reach


def is_product(n: fx.Node) -> bool:
    """A matmul of two computed values (a MoE's combine ``einsum("etd,te->td", out, gates)``):
    linear in each, so a partial sum times a whole value stays a sum."""
    return n.target in _PRODUCTS and not any(
        stored_inputs(a) is not None for a in n.all_input_nodes)


def computed_from(nodes: list[fx.Node], order: dict, until: int) -> set[fx.Node]:
    """The values computed from any of ``nodes`` (them included), anywhere in the graph (a
    block applied twice reads its first output through the model's own code), up to position
    ``until`` of ``order`` (the graph's topological order: nothing later leads back)."""
    out, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in out and order[n] <= until:
            out.add(n)
            todo.extend(n.users)
    return out


def grad_carriers(gm: fx.GraphModule, trainable: frozenset) -> set[fx.Node]:
    """The values computed from a trainable tensor: backward sends a gradient only through
    these (a frozen model, or a block reading the caller's data, asks none of its input)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "get_attr" and n.target in trainable) or any(
                a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def reduce_points(node: fx.Node, layer: str, stop: set) -> list[fx.Node]:
    """Where one all-reduce may sum the partial gradient that backward sends to ``node`` (a
    colwise matmul's input), nearest first. Every backward op is linear in its output's
    gradient, so a partial gradient can be carried back through the computed floating-point
    values ``node`` is made from (a norm, a whole matmul, a pick), but it must be whole where
    it reaches a sink: a value of ``stop`` (a rowwise partial sum, whose backward needs it
    whole) or of another block (the block's input). The points are the values every path from
    ``node`` to a sink passes through (its dominators), sinks included; ``node`` alone when its
    gradient reaches only weights and the caller's data (callers ask only of inputs computed
    from a trainable tensor, :func:`grad_carriers`)."""
    graph, todo = nx.DiGraph(), [node]
    graph.add_node(node)
    while todo:
        n = todo.pop()
        if n.op == "placeholder":  # the caller's data: no gradient is asked of it
            continue
        if n in stop or n.op != "call_function" or layer_of(n) != layer:
            graph.add_edge(n, _SINK)
            continue
        for a in () if any_placement(n) else n.all_input_nodes:  # a fresh buffer: no data
            if stored_inputs(a) is None and differentiable(a.meta.get("val")):
                if a not in graph:
                    todo.append(a)
                graph.add_edge(n, a)
    if _SINK not in graph:  # its gradient reaches only weights (one sync for theirs) or data
        return [node]
    idom, out, at = nx.immediate_dominators(graph, node), [], _SINK
    while at is not node:
        at = idom[at]
        out.append(at)
    return out[::-1]


def _data(val) -> bool:
    """A value a matmul's operand is made of: floating point, or quantized integer data
    (torchao's int8 activations, their int32 sums); not an int64 index nor a bool mask."""
    if isinstance(val, (tuple, list)):
        return any(_data(v) for v in val)
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or (
        val.dtype not in (torch.bool, torch.int64) and not val.is_complex()))


def differentiable(val) -> bool:
    """A floating-point value, or a tuple of them (a split's pieces)."""
    if isinstance(val, (tuple, list)):
        return any(differentiable(v) for v in val)
    return isinstance(val, torch.Tensor) and val.is_floating_point()
