"""What a rewritten graph sends over the wire, and how that compares with Megatron's minimum.

Collectives are read from the rank's rewritten graph itself (the calls
:func:`~tpcompile.runtime.collectives.count_collectives` counts), so the list is exactly what runs,
conversions shared by several consumers counted once. Sizes come from the captured graph's
``meta['val']`` at the example inputs' sizes.

``bytes`` is the size of the whole tensor a collective reduces or assembles (what nccl-tests
calls the message size); a ring all-reduce moves about 2(N-1)/N of it per rank.

Megatron's minimum per repeated block is :mod:`tpcompile.inspect.bound.bound`'s, derived from the
model and not from the plan; a weight it splits that the plan keeps whole is named in the
block's row (``whole``). The code around the blocks is judged as one more block; the
collectives of the options that change it (vocabulary-parallel lookups and losses, sequence
parallelism) are not derived: their row's bound is what they cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

from torch import fx

from tpcompile.core.block_paths import block_path
from tpcompile.core.placement import Shard
from tpcompile.runtime.backward_reach import backward_nodes
from tpcompile.runtime.collectives import (
    COLLECTIVE_FNS, copy_all_into_chain, issued, sync_grad_pieces,
)
from tpcompile.inspect.trace import RewriteTrace, concrete_shape, module_path, source_node

__all__ = ["CollectiveEntry", "LayerTraffic", "list_collectives", "megatron_comparison", "nbytes",
           "dtype_name",
           "bound_verdict", "bytes_over_bound"]

@dataclass(frozen=True)
class CollectiveEntry:
    op: str                  # all_reduce | all_gather | reduce_scatter
    phase: str               # forward | backward
    shape: list              # the whole tensor's shape at the example inputs' sizes
    dtype: str
    bytes: int | None        # None when a size is symbolic without an example value
    node: str                # the captured value it converts: it runs right after this node
    module: str              # that node's module ('' for the top level)
    inserted_as: str         # the call's name in the rewritten graph (what `diff` shows)
    layer: str = ""          # the repeated block it serves ('' outside any), see _layers
    values: list = field(default_factory=list)  # every captured value it converts (a bucket: several)
    recomputed: bool = False  # a forward collective issued again by a checkpointed region's recompute


@dataclass(frozen=True)
class LayerTraffic:
    """One layer's collectives per training step against Megatron's lower bound."""

    layer: str               # 'layers.3'; '' for code outside any repeated block
    chains: list             # the plan's chains in the layer (names; the bound does not read them)
    bound_forward: int
    bound_backward: int
    bound_bytes: int
    forward: int
    backward: int
    bytes: int
    whole: list = field(default_factory=list)   # weights Megatron splits, kept whole by the plan
    bytes_known: bool = True  # False when a collective's size depends on the data (routed rows)
    # weights the bound could not judge ("weight: reason", Bound.undecided): the layer's bound
    # counts without them, so a verdict over it names them instead of claiming the bound
    undecided: list = field(default_factory=list)

    def above(self) -> bool:
        """More collectives than Megatron's, or a weight it splits left whole."""
        return bool(self.whole) or self.forward > self.bound_forward \
            or self.backward > self.bound_backward


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(shape: list, dtype) -> int | None:
    if not all(isinstance(s, int) for s in shape):
        return None
    return math.prod(shape) * dtype.itemsize


def _message_shape(call: fx.Node, value) -> list:
    shape = concrete_shape(value)
    if call.target is sync_grad_pieces:  # the replicated pieces of every weight, flattened
        sizes = []
        for w, dim, pieces in zip(*call.args[:3]):
            whole = concrete_shape(w.meta["val"])
            sizes.append(math.prod(whole) // whole[dim] * sum(e - s for s, e in pieces))
        return [sum(sizes)]
    if call.target is copy_all_into_chain:  # every value's gradient, flattened
        shapes = [concrete_shape(v.meta["val"]) for v in call.args[0]]
        if all(isinstance(d, int) for shp in shapes for d in shp):
            return [sum(math.prod(shp) for shp in shapes)]
        return [" + ".join("*".join(map(str, shp)) for shp in shapes)]  # symbolic sizes
    return shape


def _inputs(call: fx.Node) -> list[fx.Node]:
    """The values a collective call converts: several for a bucketed gradient sync, whose last
    is made in the layer whose backward completes the bucket (a value made before the layers
    joins the first layer's bucket), so the call is named after that one."""
    return list(call.args[0]) if isinstance(call.args[0], (list, tuple)) else [call.args[0]]


def _layers(trace: RewriteTrace) -> dict[str, str]:
    """The layer each collective serves, keyed by the captured value it converts.

    A value's own module can sit in the block before: the activation entering layer 3's chains
    is made by layer 2's last norm (BERT), or by the embedding for layer 0. So a chain's entries
    and exits belong to the chain's layer, then values inside a chain; others go by module. A
    value entering the chains of several layers (a text encoding every block's cross-attention
    reads) serves none of them alone: it goes by module too, as the bound counts it.
    """
    served: dict[str, set] = {}
    for c in trace.chains:
        for name in c.entries + c.exits:
            served.setdefault(name, set()).add(c.layer)
    layers = {name: next(iter(ls)) for name, ls in served.items() if len(ls) == 1}
    layer_of_chain = {c.name: c.layer for c in trace.chains}
    for name, chain in trace.chain_of.items():
        if name not in served:
            layers.setdefault(name, layer_of_chain[chain])
    return layers


def list_collectives(trace: RewriteTrace, recomputed: set = frozenset()) -> list[CollectiveEntry]:
    """Every collective the rank's graph issues per forward and per backward, in graph order;
    a gradient sync the backward never reaches (its value carries no gradient, or none comes
    back to it) is not listed: it never runs. The forward collectives of the calls in
    ``recomputed`` (:func:`~tpcompile.inspect.explain.recompute.recomputed_calls`) are listed again
    in backward, marked ``recomputed``."""
    out, layers, reached = [], _layers(trace), backward_nodes(trace.gm)
    for call in trace.gm.graph.nodes:
        if call.op != "call_function" or call.target not in COLLECTIVE_FNS:
            continue
        sources = [source_node(v, trace.plan.placements) for v in _inputs(call)]
        src, values = sources[-1], [s.name for s in sources]
        value = src.meta["val"]
        shape = _message_shape(call, value)
        forward, backward = issued(call, reached)
        again = forward if call in recomputed else ()
        runs = [("forward", op, False) for op in forward] + [
            ("backward", op, False) for op in backward] + [("backward", op, True) for op in again]
        for phase, op, repeat in runs:
            module = module_path(src)
            out.append(CollectiveEntry(op, phase, shape, dtype_name(value.dtype),
                                       nbytes(shape, value.dtype), src.name, module,
                                       call.name, layers.get(src.name, block_path(module)),
                                       values, repeat))
    return out


def megatron_comparison(trace: RewriteTrace, collectives: list[CollectiveEntry]) -> list[LayerTraffic]:
    """Per layer: Megatron's minimum (``trace.bound``) next to what tpcompile inserted."""
    rows: dict[str, dict] = {}

    def row(layer: str) -> dict:
        return rows.setdefault(layer, dict(layer=layer, chains=[], bound_forward=0,
                                           bound_backward=0, bound_bytes=0, forward=0,
                                           backward=0, bytes=0, whole=[], undecided=[],
                                           bytes_known=True))

    out = trace.bound.outside  # a row of its own where the bound or the plan pays there
    outside = [("", out)] if out is not None and (out.forward or out.backward) else []
    for layer, block in [*trace.bound.blocks.items(), *outside]:
        row(layer).update(bound_forward=block.forward, bound_backward=block.backward,
                          bound_bytes=block.bytes)
    for chain in trace.chains:
        if chain.layer in rows:
            rows[chain.layer]["chains"].append(chain.name)
    for name in trace.bound.split():
        entry = trace.plan.params.get(name)
        if entry is not None and (entry.style == "replicate" or not isinstance(entry.placement, Shard)):
            row(block_path(name))["whole"].append(name)
    for item in trace.bound.undecided:
        row(block_path(item.partition(":")[0]))["undecided"].append(item)
    for c in collectives:
        r = row(c.layer)
        r[c.phase] += 1
        r["bytes"] += c.bytes or 0
        r["bytes_known"] &= c.bytes is not None
    options = trace.plan.options
    if "" in rows and (options.vocab_parallel or options.loss_parallel or options.sequence_parallel):
        # the options' own collectives outside the blocks (the masked lookup's all-reduce, the
        # sharded loss's, the sequence gathers) are not derived: they cost what they run
        rows[""].update(bound_forward=rows[""]["forward"], bound_backward=rows[""]["backward"],
                        bound_bytes=rows[""]["bytes"])
    return [LayerTraffic(**rows[k]) for k in sorted(rows, key=_layer_order)]


def bytes_over_bound(rows: list[LayerTraffic]) -> int | None:
    """The bytes the plan's collectives carry beyond the bound's over the model; None when a
    collective's size depends on the data (a MoE's routed rows): not compared."""
    if not all(m.bytes_known for m in rows):
        return None
    return sum(m.bytes - m.bound_bytes for m in rows)


def bound_verdict(rows: list[LayerTraffic]) -> str:
    """'at the bound' (as many collectives as the bound, layer by layer or moved to the layer
    before, carrying as many bytes over the model), 'above the bound: ...' with the collectives
    or bytes paid beyond it and the weights Megatron splits that the plan keeps whole, or
    'below the bound: ...' (fewer collectives or bytes than the bound: the bound is wrong
    about the model); each followed by the weights the bound could not judge, if any (the plan
    is at the bound only for the weights it judged). Bytes are not compared where a
    collective's size depends on the data (a MoE's routed rows): the verdict says so."""
    forward = sum(max(0, m.forward - m.bound_forward) for m in rows)
    # a post-LN block all-reduces its input's gradient where the block before it (or, for the
    # first, the code outside the blocks) makes that input: a count moves to an earlier block,
    # so backward is judged on the suffixes of [outside, block 0, block 1, ...]
    ordered = [m for m in rows if not m.layer] + [m for m in rows if m.layer]
    backward = max([0, *accumulate(m.backward - m.bound_backward for m in reversed(ordered))])
    whole = [w for m in rows for w in m.whole]
    over_bytes = bytes_over_bound(rows)
    known, extra = over_bytes is not None, over_bytes or 0
    over = []
    if forward or backward:
        over.append(f"{forward:+d} forward, {backward:+d} backward collectives")
    if extra > 0:
        over.append(f"{extra:+,} bytes beyond the bound's {sum(m.bound_bytes for m in rows):,}")
    if whole:
        shown = ", ".join(whole[:3]) + (f" and {len(whole) - 3} more" if len(whole) > 3 else "")
        over.append(f"{len(whole)} weight tensor(s) Megatron splits kept whole ({shown})")
    fewer = [(sum(getattr(m, f"bound_{k}") for m in rows) - sum(getattr(m, k) for m in rows), k)
             for k in ("forward", "backward")]
    fewer = [f"{n} {k} collectives" for n, k in fewer if n > 0] + (
        [f"{-extra:,} bytes"] if extra < 0 else [])
    said = ("above the bound: " + "; ".join(over) if over
            else f"below the bound: {', '.join(fewer)} fewer than the bound derived from the "
                 "model, which misjudged it" if fewer
            else "at the bound" + ("" if known else
                                   " (bytes not compared: a collective's size depends on the data)"))
    undecided = [u for m in rows for u in m.undecided]
    if undecided:
        said += (f"; {len(undecided)} weight(s) not judged, the bound counts without them: "
                 + "; ".join(undecided))
    return said


def _layer_order(layer: str):
    """'layers.2' before 'layers.10'; code outside layers last."""
    head, _, index = layer.rpartition(".")
    return (layer == "", head, int(index) if index.isdigit() else 0, layer)
