"""Megatron's bound: the plan Megatron-LM would write for a model, derived from the model.

The bound is computed from the captured graph before planning, never from tpcompile's plan,
so a weight the planner leaves whole cannot shrink it. Definition, per repeated block (the
module path up to its first ModuleList index, :func:`~tpcompile.core.block_paths.block_path`):

* A *matmul* is a node the rule table marks ``matmul`` with one operand computed from stored
  tensors only (a parameter, its views, a quantized weight's dequantization); its *weight* is
  that operand's largest tensor, its *activation* the other operand.
* A *low-rank pair* is a matmul whose output features are at most a quarter of its input
  features, or whose output is normalized whole and expanded at least 4x into heads (the down
  factor), followed, within the block, by a matmul reading no more features than that (the up
  factor): a LoRA adapter, an MLA down/up projection (at a width where the latent is not
  narrower than the model too). Megatron splits one
  factor and keeps the narrow side whole; the pair counts as one matmul.
* Styles, in graph order: a matmul whose activation depends (within the block, not through
  another matmul) on a column-parallel output is *rowwise*; any other is *colwise*. A pair's
  down factor is whole when the pair is colwise and rowwise when it is rowwise (the up factor
  the reverse), unless the rowwise pair's up output is not summed with another rowwise
  matmul's: then the down factor's sum is reduced first and the up factor is colwise (Mamba's
  ``x_proj -> dt_proj``). Kept *whole*, each with its reason: a matmul whose output reaches
  ``topk`` (a router gate); a colwise matmul whose output reaches no rowwise one (its cut would
  have to be gathered); a colwise matmul whose output is viewed as fewer heads than ranks (KV
  heads) or whose output features do not divide; a matmul on one row per sample (a timestep embedder, an adaLN modulation on ``(batch, dim)``
  in a model with token rows) whose chain (it, the matmuls it feeds, their weights, their
  outputs' all-reduces and its input's gradient sync) does not pay under the planner's cost
  rule (:func:`~tpcompile.passes.planner.chain_cost.per_sample_chain` and
  :func:`~tpcompile.passes.planner.chain_cost.chain_cost`, what the planner asks), judged in
  graph order before the styles, so that it starts no chain.
  The code around the repeated blocks is judged as one more block (``outside``; a model
  with no repeated blocks is all of it): an LM head's output reaches no row-parallel matmul
  (whole), embeddings are lookups, not matmuls (whole), and a projector MLP there (a text
  embedder, LLaVA's multimodal projector: Megatron-LM's ``MultimodalProjector``) is a chain,
  but not one through a norm over the cut features (BERT's and Electra's LM head transform). A bias follows a colwise weight and
  stays whole with a rowwise one.
* Forward: one all-reduce per group of rowwise matmuls whose partial sums meet through linear
  ops (sums, scalings, a ``cat`` of them) before any other use (a MoE block's routed and
  shared experts: one), of the bytes of the value where the sum leaves them; and one per
  statistic (a norm's mean, a quantization's max or min) over a colwise matmul's whole output
  features, or over all heads of attention's output when the matmul makes its value or its
  query (BitNet's norm before ``o_proj``, a per-token scale there). A max and a min of one
  value that meet through ``maximum`` / ``minimum`` / ``neg`` (a symmetric scale: the largest
  magnitude) are one. Walking upstream from a matmul, a statistic ends the path (it is whole
  once all-reduced), and so does a size read.
* Backward (for inputs computed from a trainable tensor: a frozen model, or a block reading
  the caller's data, asks no input gradient): one all-reduce per group of colwise inputs
  whose partial gradients can be summed at one value (``reduce_points``): backward is linear in the gradient, so a partial gradient
  is carried back through the whole computation its input is made of (views, picks, norms,
  whole matmuls) until it must be whole, where it enters a rowwise partial sum or leaves the
  block. q, k and v: one; a MoE block's routed and shared experts: one; MLA's q path and its
  latent kv path, through the whole down projections: one; a parallel block's two norms of
  one input: one. This is below Megatron-LM's count (one per column-parallel input) where
  paths meet through whole weights, whose gradients then ride in the same all-reduce. Of the
  bytes of the value they meet at; one more for the gradients of the statistics that follow
  such a group's inputs (groups ready together, below, share it too). Groups whose values are not computed from each other's colwise
  matmuls are ready together and share one all-reduce of several tensors (joint attention's
  image and context streams; a decoder's self-attention input and the encoder memory its
  cross-attention reads): the count is the longest chain of groups that wait on one another. Whole non-matmul weights read where features are cut (a per-head
  q / k norm's weight) have partial gradients that ride in the sync of the colwise input they
  are read after: bytes, not an all-reduce of their own.
* A colwise matmul whose output is cut (split, head slices, list indices; inside a piece also
  after channelwise ops, Mamba-2's depthwise conv1d) into pieces, some viewed as fewer heads
  than ranks (a fused qkv's one kv head under MQA, Mamba-2's one B / C group), keeps those
  pieces' rows whole (``Bound.whole_rows``): their gradient is a partial sum, one backward
  all-reduce of its own; a matmul whose every piece is so is whole. A statistic over all the
  features of one piece (Mamba-2's gated norm over its z piece) counts as one over the matmul.
* The bytes each all-reduce carries, where a hand plan takes it most cheaply (and the values
  whose gradients ride in it): :mod:`tpcompile.inspect.bound.bound_bytes`.
* Ideal parameter bytes per rank: the split weights' bytes / N (their whole rows whole) plus
  the whole ones'.

Pieces are followed from the matmul's output only through views, cuts and channelwise ops: a
piece computed with other values first is not seen, and counted split. A matmul whose sizes
have no example value is not judged: it is named in ``Bound.undecided`` with the reason.

What it shares with the planner, and what is its own. Shared are facts about an op or a
tensor that say nothing about how to cut it, which both must read alike or the bound would
judge another graph: the rule table's fields ``matmul`` (which ops are matmuls,
``is_param_matmul``), ``view`` (which ops only re-index a value, ``is_view``) and
``attention`` (``is_attention``), and the fresh buffers ``writes.any_placement`` names (no use
of a value); which stored tensors make a quantized weight
(:mod:`tpcompile.passes.planner.rules.quantized`); the repeated block a node is in
(:mod:`tpcompile.core.block_paths`, the chain report's answer too); and the cost rule's chain
and price (:mod:`tpcompile.passes.planner.chain_cost`), a stated model the bound must not
price differently. Its own are the op sets of :mod:`tpcompile.inspect.bound.bound_graph` (ops that keep a
partial sum a sum, join sums, cut a value into pieces, keep features apart, take a statistic
over features; ``topk`` as a router) and the styles above: those are what the rule table's
``propagate`` functions decide, and an oracle that read them would inherit a rule's mistake
instead of catching it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpcompile.core.block_paths import block_path
from tpcompile.core.capture import Capture, module_path
from tpcompile.inspect.bound.bound_bytes import (
    before_summands, cut_region, entering, reduced_bytes, scales, sync_bytes, values_bytes,
    whole_part_bytes, whole_read,
)
from tpcompile.inspect.bound.bound_graph import (
    Matmul, computed_from, find_matmuls, grad_carriers, reach_forward, reduce_points,
    value_bytes,
)
from tpcompile.inspect.bound.bound_styles import is_up_of_row, roles, unpaid_matmuls, whole_rows
from tpcompile.passes.planner.rules.quantized import (
    is_quantized_storage, stored_inputs, weight_targets,
)
from tpcompile.runtime.backward_reach import backward_nodes

__all__ = ["Bound", "BlockBound", "megatron_bound"]

LOW_RANK = 4  # a down factor's output is at most 1/LOW_RANK of its input features


@dataclass(frozen=True)
class BlockBound:
    """Megatron's collectives for one repeated block, per training step."""

    layer: str
    forward: int
    backward: int
    bytes: int
    whole_grads: tuple[str, ...] = ()  # whole weights read where features are cut
    # the values Megatron all-reduces: the rowwise partial sums up to where they are reduced,
    # and the activations entering the colwise matmuls (node names of the captured graph)
    values: dict = field(default_factory=lambda: {"forward": (), "backward": ()})


@dataclass(frozen=True)
class Bound:
    styles: dict             # weight (get_attr target) -> colwise | rowwise | whole
    reasons: dict            # weight -> why Megatron keeps it whole (whole weights only)
    blocks: dict             # repeated block (layer) -> BlockBound
    ideal_bytes: float       # parameter bytes per rank under Megatron's plan
    world_size: int = 1
    undecided: list = field(default_factory=list)  # weights not judged, each with the reason
    # colwise weights with a part Megatron keeps whole (a fused qkv's kv rows under MQA):
    # weight -> the fraction of its rows kept whole
    whole_rows: dict = field(default_factory=dict)
    outside: BlockBound | None = None  # the code around the repeated blocks, judged as one

    def split(self) -> list[str]:
        return sorted(w for w, s in self.styles.items() if s != "whole")


def _forward(layer: str, mms: list[Matmul], role: dict, trainable: frozenset,
             carriers: set) -> tuple[int, int, set, list]:
    """(all-reduces, bytes, the partial sums, the values scaling them before their
    all-reduce): one per group of rowwise matmuls whose partial sums meet. A group of one
    matmul is reduced at its output or where its sum leaves, whichever costs fewer bytes with
    the scales' gradients (an adaLN-Zero gate: at the output), and before a residual joins
    it (:func:`before_summands`)."""
    rows = [m.node for m in mms if role.get(m.node) == "rowwise"]
    through = {m.node for m in mms if role.get(m.node) == "whole" and is_up_of_row(m.node, mms, role)}
    reach = {r: reach_forward(r, layer, through) for r in rows}
    groups: list[set] = []
    for r in rows:  # union rows whose sums meet
        joined = [g for g in groups if any(reach[r] & reach[o] for o in g)]
        groups = [g for g in groups if g not in joined] + [{r}.union(*joined)]
    partial = set().union(*reach.values())
    total, scaled = 0, []
    for g in groups:
        summed = set().union(*(reach[r] for r in g))
        if len(g) == 1:  # a lone sum is reduced before the residual joins it
            summed = before_summands(summed)
        found = scales(summed, carriers)
        late = reduced_bytes(summed) + values_bytes(found, layer, trainable, partial)
        early = value_bytes(next(iter(g))) if len(g) == 1 else None
        total += late if early is None or late < early else early
        scaled += found if early is None or late < early else []
    return len(groups), total, partial, scaled


def _block(layer: str, mms: list[Matmul], role: dict, trainable: frozenset,
           world_size: int, carriers: set, priced: set) -> BlockBound:
    """Forward groups and statistics; backward activations and statistics' gradients. The
    whole weights read where features are cut add bytes, not an all-reduce: they are read
    after a colwise matmul, so their partial gradients ride in that matmul's input sync (an
    all-reduce of their own only in a block with no colwise input to sync). So does the
    gradient of a trainable KV projection kept whole (fewer heads than ranks) that attention
    cut by query heads reads: partial on each rank, summed as its output's gradient or its
    weight's, whichever is smaller. A colwise weight with whole rows (``whole_rows``) adds one
    all-reduce of those rows' gradient."""
    forward, forward_bytes, partial, scaled = _forward(layer, mms, role, trainable, carriers)
    cols = [m for m in mms if role.get(m.node) == "colwise"]
    groups = _input_syncs(layer, [m for m in cols if m.activation in carriers], partial)
    # a value made outside the block and read by several blocks (a text encoding every block's
    # cross-attention reads) is summed once: its bytes count in the first block that reads it
    shared = [frozenset(m.activation for m in members) for members, _ in groups]
    shared = {i: key for i, key in enumerate(shared) if all(block_path(module_path(a)) != layer
                                                            for a in key)}
    again = {i for i, key in shared.items() if key in priced}
    priced |= set(shared.values())
    syncs = {points[0]: members for members, points in groups}
    roots = set(syncs)
    stats = {s for m in cols for s in m.statistics}
    # statistics' gradients (of the matmuls backward reaches): one all-reduce per colwise
    # input they follow (OLMo 2's q and k norms together; BitNet's norms after attention and
    # in the MLP one each), inputs ready together sharing one; an inference-only block's
    # statistics are summed forward only
    grad_stats = {s for group in syncs.values() for m in group for s in m.statistics}
    # ready together as their input syncs are (a cross-attention's q and k norms): one round
    stat_syncs = {r: group for r, group in syncs.items() if any(m.statistics for m in group)}
    whole = whole_read(layer, cols, mms, trainable, world_size)
    fused = [(m, whole_rows(m, world_size)) for m in cols]
    fused = [_weight_bytes(m) * rows // m.out_features for m, rows in fused if rows]
    kv = [m for m in mms if role.get(m.node) == "whole" and m.heads is not None
          and m.heads < world_size and set(m.weights) & trainable
          and any(role.get(d) == "rowwise" for d in m.downstream)]  # read by the cut heads
    by_node = {m.node: m for m in mms}
    enter = entering(layer, cols, mms, carriers,
                     {m.node for m in kv} | cut_region(layer, kv, by_node)) if roots else []
    return BlockBound(layer, forward + len(stats),
                      _sync_rounds(syncs) + _sync_rounds(stat_syncs)
                      + bool((whole or kv) and not roots) + len(fused),
                      forward_bytes + sum(value_bytes(n) for n in stats)
                      + sum(sync_bytes([m.activation for m in members], points, layer,
                                       trainable, partial)
                            for i, (members, points) in enumerate(groups) if i not in again)
                      + values_bytes(enter, layer, trainable, partial)
                      + sum(value_bytes(n) for n in grad_stats)
                      + sum(value_bytes(w) for w in whole) + sum(fused)
                      + (whole_part_bytes(layer, cols, mms, trainable, world_size) if fused else 0)
                      + sum(min(value_bytes(m.node), _weight_bytes(m)) for m in kv),
                      tuple(sorted({w.target for w in whole})),
                      {"forward": tuple(sorted(n.name for n in partial | stats)),
                       "backward": tuple(sorted(n.name for n in roots | grad_stats
                                               | set(enter) | set(scaled)))})


def _weight_bytes(m: Matmul) -> int:
    """The bytes of ``m``'s weight gradient (in the dtype it computes in)."""
    return m.node.meta["val"].dtype.itemsize * m.in_features * m.out_features


def _input_syncs(layer: str, cols: list[Matmul], partial: set) -> list[tuple[list, list]]:
    """The backward all-reduces of the colwise matmuls' inputs: (the matmuls whose input
    gradients one sums, the values it may sum them at, nearest first). Inputs that share a
    reduce point (:func:`reduce_points`) share one all-reduce (q, k and v at their norm's
    output; an MLA block's q and kv paths, through their whole down factors, at the block's
    norm; a parallel block's two norms at the block's input)."""
    groups: list[tuple[list, list]] = []  # (matmuls, the points they all share)
    for m in cols:
        points = reduce_points(m.activation, layer, partial)
        shared = next((g for g in groups if set(g[1]) & set(points)), None)
        if shared is None:
            groups.append(([m], points))
        else:
            shared[0].append(m)
            shared[1][:] = [p for p in shared[1] if p in points]
    return groups


def _sync_rounds(syncs: dict) -> int:
    """The backward all-reduces the input syncs (``_input_syncs``) need. A sync waits on
    another when its value is computed from the other's colwise matmuls (its gradient flows
    back through them); syncs that wait on none of each other are ready together and share one
    all-reduce of several tensors, as ``insert_collectives`` buckets them (joint attention's
    image and context q / k / v inputs). The fewest all-reduces is then the longest chain of
    waits (Mirsky's theorem: a partial order's fewest antichains)."""
    if not syncs:
        return 0
    order = {n: i for i, n in enumerate(next(iter(syncs)).graph.nodes)}
    last = max(order[p] for p in syncs)
    height, made = {}, {}
    for point in sorted(syncs, key=order.__getitem__):  # what a sync waits on comes first
        made[point] = computed_from([m.node for m in syncs[point]], order, last)
        waits = [height[p] for p in height if point in made[p]]
        height[point] = 1 + max(waits, default=0)
    return max(height.values())


def _undequantized(cap: Capture, found: list[Matmul]) -> list[str]:
    """Quantized data of subclass weights that no matmul of a float weight reads (an integer
    matmul of dynamically quantized activations): not judged, each named."""
    judged = {leaf.target for m in found for a in m.node.all_input_nodes if a is not m.activation
              for leaf in (stored_inputs(a) or ([], []))[0]}
    return [f"{n.target}: quantized data its matmul reads as stored, with activations "
            "quantized per token (no float weight the bound knows)"
            for n in cap.gm.graph.find_nodes(op="get_attr")
            if n.target in cap.subclass_parts and n.target not in judged
            and is_quantized_storage(n)]


def megatron_bound(cap: Capture, world_size: int, chain_cost: str = "cuda") -> Bound:
    """Megatron's plan of ``cap``'s model on ``world_size`` ranks (see the module docstring);
    ``chain_cost``: the device the cost rule prices per-sample chains on (``PlanOptions``')."""
    found = find_matmuls(cap, LOW_RANK)
    mms = [m for m in found if m.out_features and m.in_features]
    undecided = [f"{w}: its matmul's features have no example size" for m in found
                 if m not in mms for w in m.weights] + _undequantized(cap, found)
    by_layer: dict[str, list[Matmul]] = {}
    for m in mms:
        by_layer.setdefault(block_path(module_path(m.node)), []).append(m)
    styles, reasons, blocks, whole_part, priced = {}, {}, {}, {}, set()
    # an inference-only capture (custom autograd Functions under no_grad) runs no backward
    trainable = frozenset() if cap.inference_only else cap.trainable
    # inputs whose gradient anything asks and comes back (not a branch only a discarded
    # output reads: LTX-2's audio stream after its last block)
    carriers = backward_nodes(cap.gm, grad_carriers(cap.gm, trainable))
    for layer, group in by_layer.items():  # "": the code around the blocks, judged as one
        unpaid = unpaid_matmuls(cap, group, world_size, chain_cost, carriers, [m.activation for m in mms])
        # "": around the blocks, or a model without blocks, judged as one block
        role, why = roles(group, world_size, layer, unpaid, around=not layer and len(by_layer) > 1)
        for m in group:
            style = role[m.node]
            for w in m.weights:
                styles[w] = style
                if style == "whole":
                    reasons[w] = why[m.node]
            for b in m.biases:
                styles[b] = "colwise" if style == "colwise" else "whole"
                if styles[b] == "whole":
                    reasons[b] = why.get(m.node, "a row-parallel matmul's bias is added after the sum")
        blocks[layer] = _block(layer, group, role, trainable, world_size, carriers, priced)
        for m in group:
            rows = whole_rows(m, world_size) if role[m.node] == "colwise" else 0
            for w in m.weights + m.biases if rows else ():
                whole_part[w] = rows / m.out_features
    ideal = _ideal_bytes(cap, styles, whole_part, world_size)
    return Bound(styles, reasons, blocks, ideal, world_size, undecided, whole_part,
                 blocks.pop("", None))


def _ideal_bytes(cap: Capture, styles: dict, whole_part: dict, world_size: int) -> float:
    """Every parameter and quantized weight tensor (what explain's parameter bytes count) once:
    split ones / N (but their ``whole_part`` whole), the rest whole (aliases of a tied weight
    once)."""
    seen, total, counted = set(), 0.0, weight_targets(cap)
    for n in cap.gm.graph.find_nodes(op="get_attr"):
        names = cap.aliases.get(n.target, (n.target,))
        if n.target not in counted or names in seen:
            continue
        seen.add(names)
        size = value_bytes(n)
        if styles.get(n.target, "whole") == "whole":
            total += size
        else:
            part = whole_part.get(n.target, 0.0)
            total += size * (1 - part) / world_size + size * part
    return total
