"""In-place writes into fresh graph-local buffers, rewritten into their out-of-place forms.

Model code often builds a result by writing into a buffer it just created:
Mixtral's expert loop accumulates ``out.index_add_(0, token, y)`` into ``torch.zeros_like(x)``,
MLA's ``expand_kv`` fills ``buf = x.new_empty(...)`` by ``buf[..., :k].copy_(a)``.
torch.export keeps these writes in place, and in-place ops tie placements to storage (see
:mod:`tpcompile.passes.planner.mutations`): the planner can only keep them replicated. When
the written tensor is *fresh* (made inside the graph by a factory op, or by any op whose schema
returns a new tensor: not an input, buffer, parameter or view) and no other view of it is read
after the write, nothing else can observe its storage, so the write is a value (the gated delta
rule's forward substitution ``ut[..., i, :i] = ...`` into ``ut = -x.tril(-1)``, too):
``index_add_`` becomes ``index_add``, a ``copy_`` into ``buf[..., :k]`` becomes
``slice_scatter(buf, a.expand_as(buf[..., :k]), -1, 0, k)``, and every later reader of the
buffer reads the new value. The rule table then sees functional ops only
(``index_add`` of partial expert outputs into zeros stays partial: one all-reduce per MoE
block instead of one per expert).

The out-of-place overload of an in-place op comes from torch's own naming relation
(``aten.index_add_.default`` -> ``aten.index_add.default``); only the views the rule table
gives a scatter inverse (``SCATTERS``: ``slice``, ``select``) are written through, and it says
what a ``copy_`` writes (``value_of_write``); a cast to the tensor's own dtype on the way is
the tensor itself, as in eager, and is dropped. Anything else stays in place.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from tpcompile.passes.planner.dims import val
from tpcompile.passes.planner.mutations import aliases, written_args
from tpcompile.passes.planner.rules import FRESH_BUFFERS, SCATTERS, value_of_write

__all__ = ["functionalize_fresh_writes_pass", "out_of_place"]

aten = torch.ops.aten


def out_of_place(target) -> torch._ops.OpOverload | None:
    """``aten.index_add_.default`` -> ``aten.index_add.default`` (None if torch has none)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    functional = getattr(packet, target._overloadname, None) if packet is not None else None
    if functional is None or functional._schema.is_mutable:
        return None
    return functional


def _written_through(node: fx.Node, fresh: set[fx.Node]) -> list[fx.Node] | None:
    """[base, view, ..., written] when ``node`` writes a fresh buffer directly or through
    single-use slices/selects of it, else None."""
    written = written_args(node)
    if len(written) != 1 or written[0] is not node.args[0]:
        return None
    chain = [written[0]]
    while chain[0] not in fresh:
        view = chain[0]
        if (view.op != "call_function" or view.target not in SCATTERS
                or len(view.users) != 1 or not isinstance(view.args[0], fx.Node)):
            return None
        chain.insert(0, view.args[0])
    return chain


_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other)


def _identity_cast(node: fx.Node) -> bool:
    """``x.to(dtype)`` of ``x``'s own dtype and device, no copy asked: torch returns ``x``
    itself (CogView4's ``norm_q(query).to(dtype=dtype)`` before writing rotary into a slice)."""
    if node.op != "call_function" or node.target not in _CASTS or not isinstance(node.args[0], fx.Node):
        return False
    out, x = val(node), val(node.args[0])
    kw = node.kwargs
    return (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.dtype == x.dtype
            and out.device == x.device and not kw.get("copy", False)
            and kw.get("memory_format") in (None, torch.preserve_format))


def _drop_identity_casts(g: fx.Graph, written: fx.Node) -> None:
    """Identity casts between a written view and its base, replaced by what they cast: the
    write lands in the base, as in eager."""
    node = written
    while node.op == "call_function" and isinstance(node.args[0], fx.Node):
        base, cast = node.args[0], _identity_cast(node)
        if cast:
            node.replace_all_uses_with(base)
            g.erase_node(node)
        elif node.target not in SCATTERS:
            return
        node = base


def _unobserved(chain: list[fx.Node], node: fx.Node, order: dict) -> bool:
    """Every other view of the buffer taken before the write is read only before it (a view
    read after it would see the write): the gated delta rule's ``row = ut[..., i, :i].clone()``
    before ``ut[..., i, :i] = row + ...``."""
    views = aliases(chain[0]) - set(chain) - aliases(node)
    return all(order[v] > order[node] or all(order[u] < order[node] for u in v.users)
               for v in views)


def _computed(node: fx.Node) -> bool:
    """A result with storage of its own: its op's schema returns a new tensor (no alias
    annotation: ``-x.tril(-1)``, not ``x.view(...)``) and writes nothing."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return (schema is not None and not schema.is_mutable and len(schema.returns) == 1
            and schema.returns[0].alias_info is None and isinstance(val(node), torch.Tensor))


def _write_back(g: fx.Graph, node: fx.Node, functional, chain: list[fx.Node]) -> fx.Node:
    """The out-of-place op on the written view, scattered back through each view to the base."""
    value = value_of_write(g, node, functional)
    value.meta.update(node.meta)
    for view, inner in zip(reversed(chain[1:]), reversed(chain[:-1])):
        value = g.call_function(SCATTERS[view.target], (inner, value, *view.args[1:]), view.kwargs)
        value.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        value.meta["val"] = inner.meta.get("val")
    return value


def functionalize_fresh_writes_pass(gm: fx.GraphModule) -> PassResult:
    """Rewrite in-place writes into fresh buffers (see module docstring).

    Into a computed result only writes through a view are rewritten: a whole-tensor in-place
    op (``relu_``, ``+=``) already has a rule and runs on each rank's shard, saving memory."""
    g = gm.graph
    fresh = {n for n in g.nodes if n.op == "call_function" and n.target in FRESH_BUFFERS}
    computed = {n for n in g.nodes if _computed(n)} - fresh
    order = {n: i for i, n in enumerate(g.nodes)}
    changed = False
    for node in list(g.nodes):
        functional = out_of_place(node.target) if node.op == "call_function" else None
        if functional is not None and len(written := written_args(node)) == 1:
            _drop_identity_casts(g, written[0])
        chain = _written_through(node, fresh | computed) if functional is not None else None
        if chain is None or (len(chain) > 1 and node.users) or not _unobserved(chain, node, order):
            continue
        if chain[0] in computed and len(chain) == 1:  # a whole-tensor in-place op: ruled as is
            continue
        base = chain[0]
        later = [u for u in base.users if u not in chain and order[u] > order[node]]
        before = node.prev
        with g.inserting_before(node):
            value = _write_back(g, node, functional, chain)
        made = before.next
        while made is not node:  # the new nodes stand where the write stood
            order[made], made = order[node], made.next
        node.replace_all_uses_with(value)
        for user in later:
            user.replace_input_with(base, value)
        g.erase_node(node)
        fresh.add(value)
        changed = True
    return PassResult(gm, changed)
