"""Limits a call's inputs must respect that come from the model, not from the example call.

Two kinds, both found once in the rewritten graph and checked before it runs:

- **Size ranges export kept.** A symbolic size can carry a range: slicing a 64-row position
  table by the sequence length and broadcasting the slice against the activations makes export
  record ``tokens.size()[1] <= 64``. The unlifted graph checks it in its ``_guards_fn`` with a
  bare ``AssertionError: Guard failed: ...``; :class:`Limit` says the same in an
  :class:`InputError` naming the input, the dim, the limit and, when the graph shows it, the
  tensor whose length sets it. A size that counts positions looked up in a table
  (``embedding(wpe, arange(T))``) has no guard but the same limit: the table's rows.
- **Embedding rows.** An input whose values index an embedding table must be in
  ``[0, rows)``. A replicated table would raise torch's ``IndexError: index out of range in
  self`` (on GPUs a device-side assert that poisons the CUDA context); a vocabulary-parallel
  table would raise from inside the graph, after this rank's peers may already have entered a
  collective. Checking up front costs one ``aminmax`` and one host sync per indexing input.
  Positions a static KV cache is written at (``cache[:, :, input_pos] = k``) are checked the
  same way against the cache's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses import FakeTensor
from torch.utils._sympy.numbers import int_oo

from tpcompile.errors import InputError

__all__ = ["Limit", "TokenTable", "SAME_VALUES", "dim_limits", "token_tables", "check_tokens"]

EXPORT_FLOOR = 2  # export assumes symbolic sizes >= 2 (0/1 specialisation); not a model limit
_aten = torch.ops.aten
# ops whose output holds values of their first argument, moved, copied, sliced or cast but not
# computed: an input's token ids reach a table through them as ids. The fact is the runtime's
# (the input check below follows it through the graph a call runs, layers under the rule
# table); the planner's vocabulary rule asks the same question of the same set
SAME_VALUES = frozenset({
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
    _aten.flatten.using_ints, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.default,
    _aten.clone.default, _aten.contiguous.default, _aten.permute.default, _aten.transpose.int,
    _aten.t.default, _aten.alias.default, _aten.detach.default, _aten.expand.default,
    _aten.slice.Tensor, _aten._to_copy.default,
})


@dataclass(frozen=True)
class Limit:
    """The range one symbolic size of an input must stay in, and where the model sets it."""

    low: int | None  # None: nothing above export's own floor of 2
    high: int | None
    why: str  # "the captured guard tokens.size()[1] <= 64; the model slices rope_cos ..."

    def check(self, name: str, dim: int, size: int) -> None:
        hint = ("\n  hint: the limit is the model's (a max sequence length, a position table): "
                "shorten the input, or build the model with a larger limit and parallelize it again")
        if self.high is not None and size > self.high:
            raise InputError(f"input {name}: dim {dim} is {size} but the model supports at most "
                             f"{self.high} ({self.why}){hint}")
        if self.low is not None and size < self.low:
            raise InputError(f"input {name}: dim {dim} is {size} but the model needs at least "
                             f"{self.low} ({self.why}){hint}")


def dim_limits(gm: fx.GraphModule, placeholder: fx.Node) -> tuple:
    """Per dim of ``placeholder``: its :class:`Limit`, or None when its size is unbounded."""
    out = []
    for d, size in enumerate(placeholder.meta["val"].shape):
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if expr is None or not expr.is_symbol:
            out.append(None)
            continue
        vr = size.node.shape_env.var_to_range.get(expr)
        high = int(vr.upper) if vr is not None and vr.upper != int_oo else None
        low = int(vr.lower) if vr is not None and vr.lower > EXPORT_FLOOR else None
        guard = f"{placeholder.name}.size()[{d}]"
        if high is not None or low is not None:
            bounds = " and ".join([f"{guard} >= {low}"] * (low is not None)
                                  + [f"{guard} <= {high}"] * (high is not None))
            out.append(Limit(low, high, f"the captured guard {bounds}{_sliced(gm, expr, high)}"))
        else:  # no guard, but positions 0..size-1 may index a table: IndexError past its end
            out.append(_positions(gm, expr))
    return tuple(out)


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _is(arg, symbol) -> bool:
    v = _val(arg)
    return isinstance(v, torch.SymInt) and v.node.expr == symbol


def _sliced(gm: fx.GraphModule, symbol, high: int | None) -> str:
    """A tensor the graph slices by ``symbol`` whose length is the upper limit, named."""
    for node in gm.graph.find_nodes(op="call_function", target=_aten.slice.Tensor):
        args = list(node.args) + [None] * (4 - len(node.args))  # (self, dim, start, end)
        src, dim, end = args[0], args[1] or 0, args[3]
        if _is(end, symbol) and isinstance(_val(src), torch.Tensor) and _val(src).shape[dim] == high:
            return f"; the model slices {_name(src)} ({high} long in dim {dim}) by it"
    return ""


def _positions(gm: fx.GraphModule, symbol) -> Limit | None:
    """``embedding(table, arange(size))``: a size beyond the table's rows has no position."""
    for node in gm.graph.find_nodes(op="call_function", target=_aten.embedding.default):
        ids = node.args[1]
        if ids.op == "call_function" and ids.target is _aten.arange.default and _is(ids.args[0], symbol):
            rows = _val(node.args[0]).shape[0]
            return Limit(None, rows, f"positions 0..{rows - 1} index the {rows} rows of "
                                     f"{_name(node.args[0])}")
    return None


def _name(node: fx.Node) -> str:
    return node.target if node.op == "get_attr" else node.name


@dataclass(frozen=True)
class TokenTable:
    """An embedding table whose rows are indexed by the values of flat input ``index``."""

    index: int
    input_name: str
    table: str
    rows: int
    cache: bool = False  # positions a static KV cache is written at (rows: its length)


def token_tables(gm: fx.GraphModule) -> tuple[TokenTable, ...]:
    """Every embedding lookup (replicated, column-sharded or vocabulary-parallel) whose ids
    are an input's values, moved or relabelled but not changed."""
    from tpcompile.runtime.vocab import vocab_parallel_embedding  # vocab imports this package

    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    out = []
    for node in gm.graph.nodes:
        if node.target is _aten.embedding.default:
            rows = node.args[0].meta["val"].shape[0]  # an aten.embedding table holds every row
        elif node.target is vocab_parallel_embedding:  # (weight, ids, start, stop, pad, vocab)
            rows = node.kwargs.get("vocab", node.args[5] if len(node.args) > 5 else None)
        else:
            continue
        if rows is None:
            continue
        ids = _input_behind(node.args[1])
        if ids in placeholders:
            out.append(TokenTable(placeholders[ids], ids.name, _name(node.args[0]), rows))
    return tuple(out) + _cache_positions(gm, placeholders)


def _input_behind(ids: fx.Node) -> fx.Node:
    while ids.op == "call_function" and ids.target in SAME_VALUES:
        ids = ids.args[0]
    return ids


def _cache_positions(gm: fx.GraphModule, placeholders: dict) -> tuple[TokenTable, ...]:
    """Inputs whose values are the positions a buffer is written at in place
    (``cache[:, :, pos] = k``, ``cache.index_copy_(2, pos, k)``): a static KV cache's length
    bounds them. A position past it would raise inside the graph, after collectives began."""
    out = []
    for node in gm.graph.nodes:
        if node.target is _aten.index_put_.default:
            at = [(d, i) for d, i in enumerate(node.args[1]) if isinstance(i, fx.Node)]
        elif node.target is _aten.index_copy_.default:
            at = [(node.args[1], node.args[2])]
        else:
            continue
        cache = node.args[0]
        while cache.op == "call_function":  # through the views of the buffer written into
            cache = cache.args[0]
        for dim, index in at:
            ids = _input_behind(index)
            if ids in placeholders:
                rows = int(_val(node.args[0]).shape[dim])
                out.append(TokenTable(placeholders[ids], ids.name, _name(cache), rows, cache=True))
    return tuple(out)


def check_tokens(tables: tuple[TokenTable, ...], flat: list) -> None:
    """Ids outside ``[0, rows)`` of a table they index raise an :class:`InputError`."""
    seen: dict[int, tuple[int, int]] = {}
    for t in tables:
        ids = flat[t.index]
        if (not isinstance(ids, torch.Tensor) or ids.numel() == 0 or ids.device.type == "meta"
                or isinstance(ids, FakeTensor) or ids.is_floating_point()):
            continue
        if t.index not in seen:
            seen[t.index] = tuple(torch.stack(torch.aminmax(ids)).tolist())  # one host sync
        lo, hi = seen[t.index]
        if t.cache and (lo < 0 or hi >= t.rows):
            raise InputError(
                f"input {t.input_name}: cache position {hi if hi >= t.rows else lo} is outside "
                f"the KV cache {t.table} ({t.rows} positions): positions must be in "
                f"[0, {t.rows}), got values from {lo} to {hi}\n  hint: build the model with a "
                "longer cache (max_seq_length) or generate fewer tokens")
        if lo < 0 or hi >= t.rows:
            raise InputError(
                f"input {t.input_name}: token id {hi if hi >= t.rows else lo} is out of range for "
                f"the embedding {t.table} ({t.rows} rows): token ids must be in [0, {t.rows}), got "
                f"values from {lo} to {hi}\n  hint: the unsharded model would raise IndexError on "
                "them too; check the tokenizer's vocabulary size against the model's")
