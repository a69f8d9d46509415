"""Capture a deep model at the cost of a shallow one: export three blocks, stamp the rest.

torch.export is most of planning's time, and it grows with depth (8 s for a 32-layer 7B shape
on 2 cores). A stack of identical blocks has one graph per block, repeated. So: export a copy of
the model that keeps only blocks 0, 1 and 2 of its ``ModuleList`` (the same block objects, no
weights copied), check that block 2's graph is block 1's, node for node (ops, arguments,
shapes), and build the whole model's graph by repeating block 2's nodes for blocks 2 .. n-1
with their own weights. Names follow torch.export's own numbering (``linear_7``, ``linear_14``,
...), so the graph, and every plan made on it, is the one a whole export gives: the tests
``tests/unit/test_stamp.py`` and ``tests/unit/test_stamp_families.py`` compare the plans.

Blocks are reused only when they are identical in structure (:mod:`tpcompile.core.block_kinds`:
a ``layer_idx`` is no difference; blocks that alternate, such as sliding and full attention
layers, are repeated as groups of one period: three groups exported, group 2 stamped).
Otherwise, or when the blocks' nodes are interleaved or their graphs differ, the whole model
is captured and the plan's notes say why; the capture's ``reused`` names the block list and
its length only when blocks were reused. A model without a list of at least
:data:`MIN_BLOCKS` blocks is captured whole.
"""

from __future__ import annotations

import copy
import re
import types
import warnings
from dataclasses import dataclass, replace

import torch
from torch import fx, nn

from tpcompile.core.block_kinds import block_period, not_identical, signatures
from tpcompile.core.block_paths import block_of
from tpcompile.core.capture import Capture, fetch, attribute_info, capture
from tpcompile.core.checkpoint_marks import REGION
from tpcompile.core.subclass_weights import subclass_part, subclass_parts
from tpcompile.errors import TPCompileError

__all__ = ["capture_reusing_blocks", "MIN_BLOCKS", "PER_BLOCK"]

MIN_BLOCKS = 4  # with fewer, three exported blocks save nothing
# a root module's attribute naming its per-block attributes: patterns formatted with a block's
# index (the static KV cache generate captures: "key_cache_{}"), repeated with the blocks
PER_BLOCK = "per_block_attributes"
KEEP = 3        # groups exported: the first, a middle one, and the template (group 2)


def _block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's one outermost list of at least :data:`MIN_BLOCKS` modules (the lists inside
    its blocks, such as an MoE block's experts, are part of each block)."""
    lists = [(name, m) for name, m in model.named_modules()
             if name and isinstance(m, nn.ModuleList) and len(m) >= MIN_BLOCKS]
    outer = [(name, m) for name, m in lists
             if not any(name.startswith(other + ".") for other, _ in lists)]
    return outer[0] if len(outer) == 1 else None


def _truncated(model: nn.Module, path: str, blocks: nn.ModuleList, keep: int) -> nn.Module:
    """``model`` whose block list at ``path`` keeps its first ``keep`` blocks (shared)."""
    root = copy.copy(model)
    root._modules = dict(root._modules)
    *parents, leaf = path.split(".")
    holder = root
    for name in parents:
        child = copy.copy(holder._modules[name])
        child._modules = dict(child._modules)
        holder._modules[name] = child
        holder = child
    shortened = nn.ModuleList(list(blocks)[:keep])
    shortened.__class__, shortened.whole_length = _Shortened, len(blocks)
    holder._modules[leaf] = shortened
    return root


class _Shortened(nn.ModuleList):
    """The first blocks of a list, whose ``len()`` is the whole list's: a forward that counts
    its blocks (``1 / len(self.layers)``) traces as it does with all of them, and one that
    indexes a block past the kept ones raises, so the model is captured whole. A slice of it
    (``self.layers[:n]``) is built by ``ModuleList`` itself and has its own length."""

    def __len__(self) -> int:
        return self.__dict__.get("whole_length", len(self._modules))


def _number(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.*)_(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _named(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


def _relabel(meta: dict, old: str, new: str) -> dict:
    """``meta`` with module paths under block ``old`` moved to block ``new``."""
    meta = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        pattern = re.compile(re.escape(old) + r"(?=\.|$)")
        meta["nn_module_stack"] = {pattern.sub(new, k, 1): (pattern.sub(new, p, 1), t)
                                   for k, (p, t) in stack.items()}
    return meta


@dataclass(frozen=True)
class _Indexed:
    """A root attribute that belongs to one block, named by the block's index (``pattern``
    formatted with it): a static KV cache's ``key_cache_3`` is block 3's."""

    pattern: str


class _Stamper:
    """Builds the graph of ``n`` groups of ``period`` blocks from the capture ``cap`` of the
    first :data:`KEEP` groups; ``indexed``: the root's per-block attribute patterns."""

    def __init__(self, cap: Capture, path: str, n: int, period: int, indexed: tuple = ()):
        self.cap, self.path, self.n, self.period = cap, path, n, period
        self.indexed = tuple(_Indexed(p) for p in indexed)
        # the per-block root attributes of the blocks past the exported ones
        self.later = frozenset(p.format(k) for p in indexed
                               for k in range(KEEP * period, n * period))
        self.paths = [f"{path}.{i}" for i in range(KEEP * period)]
        compute = [x for x in cap.gm.graph.nodes if x.op not in ("get_attr", "placeholder", "output")]
        self.runs = {g: [] for g in range(KEEP)}  # group -> its nodes, in graph order
        for x in compute:
            block = block_of(x, self.paths)
            if block is not None:
                self.runs[self.paths.index(block) // period].append(x)
        self.per_group = {}  # name base -> nodes of that base in one group
        for x in self.runs[2]:
            base = _number(x.name)[0]
            self.per_group[base] = self.per_group.get(base, 0) + 1

    def _within(self, target: str, group: int) -> tuple[int, str | _Indexed] | None:
        """(block in the group, the rest of the name) of a name under ``group``'s blocks, or
        of a per-block root attribute of one of them (the rest: its pattern)."""
        for r in range(self.period):
            prefix = f"{self.path}.{group * self.period + r}."
            if target.startswith(prefix):
                return r, target[len(prefix):]
            for attr in self.indexed:
                if target == attr.pattern.format(group * self.period + r):
                    return r, attr
        return None

    def _target(self, group: int, r: int, rest: str | _Indexed) -> str:
        """The name of ``rest`` (as :meth:`_within` gives it) in block ``r`` of ``group``."""
        if isinstance(rest, _Indexed):
            return rest.pattern.format(group * self.period + r)
        return f"{self._block(group, r)}.{rest}"

    def _block(self, group: int, r: int) -> str:
        return f"{self.path}.{group * self.period + r}"

    def unusable(self) -> str | None:
        """Why group 2 cannot be repeated, or None: it must trace to group 1's graph, each
        group's nodes must be contiguous, and values must flow only from a group to the next
        (and from the last to the rest): a read of ``layers[-2]``'s output would name block 1
        here and block n-2 in the whole model."""
        order = {x: i for i, x in enumerate(self.cap.gm.graph.nodes)}
        for group in self.runs.values():
            if not group or order[group[-1]] - order[group[0]] + 1 != len(group):
                return "the blocks' nodes are interleaved in the graph"
        run_of = {x: g for g, run in self.runs.items() for x in run}
        for x in self.cap.gm.graph.nodes:
            reader = run_of.get(x)
            for a in x.all_input_nodes:
                source = run_of.get(a)
                if source is not None and (source != KEEP - 1 if reader is None
                                           else reader - source not in (0, 1)):
                    return f"{x.name} reads a block other than the one before it"
        if self._key(1) != self._key(2):
            return "the exported blocks trace to different graphs"
        read = next((x for x in self.cap.gm.graph.find_nodes(op="get_attr")
                     if x.target in self.later and x.users), None)
        if read is not None:
            return f"{read.target}, a later block's own, is read by {next(iter(read.users))}"
        return None

    def _key(self, i: int):
        run, prev = self.runs[i], self.runs[i - 1]
        local = {x: k for k, x in enumerate(run)}
        before = {x: k - len(prev) for k, x in enumerate(prev)}  # from its end: group 0 may
        # hold nodes of its own (what the model runs before the blocks, traced in block 0)

        def arg(a):
            if a in local:
                return ("here", local[a])
            if a in before:
                return ("previous", before[a])
            weight = self._within(a.target, i) if a.op == "get_attr" else None
            return ("weight", weight) if weight else ("shared", a.name)

        out = []
        for x in run:
            val = x.meta.get("val")
            shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else repr(val)
            out.append((x.op, str(x.target), repr(fx.node.map_arg((x.args, x.kwargs), arg)), shape))
        return out

    def graph(self) -> fx.Graph:
        g, env = fx.Graph(), {}
        first = self.runs[2][0]
        segment_ending = self._attr_segments()
        later = self.n - KEEP  # groups stamped after the template

        def shifted(x: fx.Node, groups_later: int) -> str:
            base, number = _number(x.name)
            return _named(base, number + groups_later * self.per_group.get(base, 0))

        def copy_node(x, mapping, name, group=None):
            args, kwargs = fx.node.map_arg((x.args, x.kwargs), lambda a: mapping[a])
            node = g.create_node(x.op, x.target, args, kwargs, name=name, type_expr=x.type)
            if group is None:
                node.meta = dict(x.meta)
            else:
                r = self.paths.index(block_of(x, self.paths)) % self.period
                node.meta = _relabel(x.meta, self._block(2, r), self._block(group, r))
            return node

        after = False  # past the blocks: export numbered these after n groups, not 3

        for x in self.cap.gm.graph.nodes:
            if x.op == "get_attr" and x.target in self.later:
                continue  # made with its block's copy (the root holds one for every block)
            if x.op == "get_attr" and self._within(x.target, 2):
                if x in segment_ending:  # the segment, once per group from 2 on
                    self._stamp_attrs(g, env, segment_ending[x])
                continue
            if x in self.runs[2]:
                if x is first:
                    self._stamp_groups(g, env, copy_node, shifted)
                after = True
                continue
            name = shifted(x, later) if after and x.op != "get_attr" else x.name
            mapping = {a: env[(self.n - 1, a)] if (self.n - 1, a) in env else env[a]
                       for a in x.all_input_nodes}
            env[x] = copy_node(x, mapping, name)
        with warnings.catch_warnings():  # torch's own deprecation note on copying pytree specs
            warnings.simplefilter("ignore", FutureWarning)
            g._codegen = copy.deepcopy(self.cap.gm.graph._codegen)
        return g

    def _stamp_attrs(self, g: fx.Graph, env: dict, segment: list[fx.Node]) -> None:
        for j in range(2, self.n):
            for a in segment:
                node = g.get_attr(self._target(j, *self._within(a.target, 2)))
                node.meta = dict(a.meta)
                env[(j, a)] = node

    def _attr_segments(self) -> dict[fx.Node, list[fx.Node]]:
        """Group 2's get_attrs in runs of neighbours (export lists every block's parameters,
        then every block's buffers), keyed by the last of each run."""
        segments, current = {}, []
        for x in self.cap.gm.graph.nodes:
            if x.op == "get_attr" and self._within(x.target, 2):
                current.append(x)
            elif current:
                segments[current[-1]], current = current, []
        if current:
            segments[current[-1]] = current
        return segments

    def _stamp_groups(self, g, env, copy_node, shifted):
        template, middle = self.runs[2], self.runs[1]
        position = {x: k for k, x in enumerate(middle)}
        for j in range(2, self.n):
            for x in template:
                mapping = {}
                for a in x.all_input_nodes:
                    if (j, a) in env:                    # this group's node or weight
                        mapping[a] = env[(j, a)]
                    elif a in middle and j > 2:          # the previous group's output
                        mapping[a] = env[(j - 1, template[position[a]])]
                    else:
                        mapping[a] = env[a]
                env[(j, x)] = copy_node(x, mapping, shifted(x, j - 2), j)


def _module(model: nn.Module, cap: Capture, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule over ``graph`` holding ``model``'s own tensors at their FQNs."""
    owned = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            try:
                owned[node.target] = fetch(model, node.target)
            except AttributeError:  # a subclass weight's part, or a constant export lifted
                part = subclass_part(model, node.target)
                owned[node.target] = part if part is not None else fetch(cap.gm, node.target)
        elif node.op == "call_module":
            owned[node.target] = cap.gm.get_submodule(node.target)
    gm = fx.GraphModule(owned, graph)
    for target, t in owned.items():  # buffers outside the state dict stay outside it
        holder_path, _, leaf = target.rpartition(".")
        try:
            source = model.get_submodule(holder_path)
        except AttributeError:
            continue
        if isinstance(t, torch.Tensor) and leaf in source._non_persistent_buffers_set:
            gm.get_submodule(holder_path)._non_persistent_buffers_set.add(leaf)
    for key, value in cap.gm.__dict__.items():  # pytree specs, shape env, train/eval, ...
        if key not in gm.__dict__:
            if isinstance(value, types.MethodType) and value.__self__ is cap.gm:
                value = types.MethodType(value.__func__, gm)
            gm.__dict__[key] = value
    gm.meta = dict(cap.gm.meta)
    return gm


def capture_reusing_blocks(model: nn.Module, example_inputs, example_kwargs=None, **kwargs) -> Capture:
    """:func:`~tpcompile.core.capture.capture`, exporting only three of the model's blocks
    (or groups of blocks) when they are identical (see the module docstring); the same graph
    either way: ``reused`` set when blocks were repeated, a note saying why when a block list
    was captured whole."""
    found = _block_list(model)
    if found is None:
        return capture(model, example_inputs, example_kwargs, **kwargs)
    path, blocks = found
    sigs = signatures(blocks)
    period = None if sigs is None else block_period(sigs)
    if period is None:
        return _whole(path, not_identical(sigs), model, example_inputs, example_kwargs, **kwargs)
    try:
        short = capture(_truncated(model, path, blocks, KEEP * period), example_inputs,
                        example_kwargs, **kwargs)
    except TPCompileError as e:  # a block read by index past the kept ones, or the model's own
        why = f"the first {KEEP * period} blocks alone did not capture: {str(e).splitlines()[0]}"
        return _whole(path, why, model, example_inputs, example_kwargs, **kwargs)
    stamper = _Stamper(short, path, len(blocks) // period, period,
                       getattr(model, PER_BLOCK, ()))
    why = stamper.unusable() or _checkpointed(short.gm)
    if why is not None:
        return _whole(path, why, model, example_inputs, example_kwargs, **kwargs)
    gm = _module(model, short, stamper.graph())
    gm.graph.lint()  # GraphModule() has generated its code
    aliases, params, trainable = attribute_info(gm, model)
    return replace(short, gm=gm, aliases=aliases, params=params, trainable=trainable,
                   subclass_parts=subclass_parts(model, gm),
                   reused=(path, len(blocks)))  # not a note: the plan must equal a whole capture's


def _checkpointed(gm: fx.GraphModule) -> str | None:
    """Why a capture whose blocks checkpoint regions is not stamped: a repeated block's copy
    would carry the exported block's region, and checkpoint_regions would run the blocks as
    one region (the whole capture names one region per call)."""
    if any(n.meta.get(REGION) for n in gm.graph.nodes):
        return "its blocks checkpoint regions (torch.utils.checkpoint), which are not repeated"
    return None


def _whole(path: str, why: str, model: nn.Module, *args, **kwargs) -> Capture:
    """The whole model captured, noting why its blocks were not reused."""
    cap = capture(model, *args, **kwargs)
    note = (f"{path}: captured whole, each block exported ({why}); planning time grows with "
            "depth")
    return replace(cap, notes=cap.notes + (note,))
