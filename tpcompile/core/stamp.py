"""Capture a deep model at the cost of a shallow one: export three blocks, stamp the rest.

torch.export is most of planning's time, and it grows with depth (8 s for a 32-layer 7B shape
on 2 cores). A stack of identical blocks has one graph per block, repeated. So: export a copy of
the model that keeps only blocks 0, 1 and 2 of its ``ModuleList`` (the same block objects, no
weights copied), check that block 2's graph is block 1's, node for node (ops, arguments,
shapes), and build the whole model's graph by repeating block 2's nodes for blocks 2 .. n-1
with their own weights. Names follow torch.export's own numbering (``linear_7``, ``linear_14``,
...), so the graph, and every plan made on it, is the one a whole export gives: the test
``tests/unit/test_stamp.py`` compares the plans tensor by tensor and conversion by conversion.

Blocks are reused only when they are identical in structure: same module classes, same
parameter and buffer names, shapes and dtypes, the same plain attributes, no hooks. Otherwise,
or with fewer than :data:`MIN_BLOCKS` blocks, or when the blocks' nodes are interleaved, the
whole model is captured as before; ``cap.gm.meta[REUSED]`` is set only when blocks were reused.
"""

from __future__ import annotations

import copy
import re
import types
import warnings
from dataclasses import replace

import torch
from torch import fx, nn

from tpcompile.core.block_paths import block_of
from tpcompile.core.capture import Capture, fetch, attribute_info, capture
from tpcompile.core.subclass_weights import subclass_part, subclass_parts

__all__ = ["capture_reusing_blocks", "MIN_BLOCKS", "REUSED"]

REUSED = "tpcompile_reused_blocks"  # gm.meta key: (block list path, blocks) when reused

MIN_BLOCKS = 4  # with fewer, three exported blocks save nothing
KEEP = 3        # blocks exported: the first, a middle one, and the template (block 2)


def _block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) >= MIN_BLOCKS]
    return lists[0] if len(lists) == 1 else None


def _signature(block: nn.Module):
    """What must agree for two blocks to trace to the same graph."""
    out = []
    for name, m in block.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
        tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad)
                   for n, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]
        out.append((name, type(m), repr(sorted(plain.items(), key=lambda kv: kv[0])), tensors))
    return out


def _truncated(model: nn.Module, path: str, blocks: nn.ModuleList) -> nn.Module:
    """``model`` whose block list at ``path`` keeps its first :data:`KEEP` blocks (shared)."""
    root = copy.copy(model)
    root._modules = dict(root._modules)
    *parents, leaf = path.split(".")
    holder = root
    for name in parents:
        child = copy.copy(holder._modules[name])
        child._modules = dict(child._modules)
        holder._modules[name] = child
        holder = child
    holder._modules[leaf] = nn.ModuleList(list(blocks)[:KEEP])
    return root


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


class _Stamper:
    """Builds the n-block graph from the 3-block capture ``cap``."""

    def __init__(self, cap: Capture, path: str, n: int):
        self.cap, self.path, self.n = cap, path, n
        self.blocks = [f"{path}.{i}" for i in range(KEEP)]
        nodes = list(cap.gm.graph.nodes)
        compute = [x for x in nodes if x.op not in ("get_attr", "placeholder", "output")]
        self.runs = {b: [x for x in compute if block_of(x, self.blocks) == b] for b in self.blocks}
        template = self.runs[self.blocks[2]]
        self.per_block = {}  # name base -> nodes of that base in one block
        for x in template:
            base = _number(x.name)[0]
            self.per_block[base] = self.per_block.get(base, 0) + 1

    def usable(self) -> bool:
        """Block 2 traced to block 1's graph, each block's nodes are contiguous, and values
        flow only from a block to the next (and from the last block to the rest): a read of
        ``layers[-2]``'s output would name block 1 here and block n-2 in the whole model."""
        order = {x: i for i, x in enumerate(self.cap.gm.graph.nodes)}
        for group in self.runs.values():
            if not group or order[group[-1]] - order[group[0]] + 1 != len(group):
                return False
        run_of = {x: i for i, b in enumerate(self.blocks) for x in self.runs[b]}
        for x in self.cap.gm.graph.nodes:
            reader = run_of.get(x)
            for a in x.all_input_nodes:
                source = run_of.get(a)
                if source is not None and (source != KEEP - 1 if reader is None
                                           else reader - source not in (0, 1)):
                    return False
        return self._key(1) == self._key(2)

    def _key(self, i: int):
        run, prev = self.runs[self.blocks[i]], self.runs[self.blocks[i - 1]]
        local, before = {x: k for k, x in enumerate(run)}, {x: k for k, x in enumerate(prev)}
        prefix = self.blocks[i] + "."

        def arg(a):
            if a in local:
                return ("here", local[a])
            if a in before:
                return ("previous", before[a])
            if a.op == "get_attr" and a.target.startswith(prefix):
                return ("weight", a.target[len(prefix):])
            return ("shared", a.name)

        out = []
        for x in run:
            val = x.meta.get("val")
            shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else repr(val)
            out.append((x.op, str(x.target), repr(fx.node.map_arg((x.args, x.kwargs), arg)), shape))
        return out

    def graph(self) -> fx.Graph:
        g, env = fx.Graph(), {}
        template, first = self.blocks[2], self.runs[self.blocks[2]][0]
        segment_ending = self._attr_segments(template)
        later = self.n - KEEP  # blocks stamped after the template

        def shifted(x: fx.Node, blocks_later: int) -> str:
            base, number = _number(x.name)
            return _named(base, number + blocks_later * self.per_block.get(base, 0))

        def copy_node(x, mapping, name, block=None):
            args, kwargs = fx.node.map_arg((x.args, x.kwargs), lambda a: mapping[a])
            node = g.create_node(x.op, x.target, args, kwargs, name=name, type_expr=x.type)
            node.meta = _relabel(x.meta, template, block) if block else dict(x.meta)
            return node

        after = False  # past the blocks: export numbered these after n blocks, not 3

        for x in self.cap.gm.graph.nodes:
            if x.op == "get_attr" and x.target.startswith(template + "."):
                if x in segment_ending:  # the segment, once per block from the template on
                    for j in range(2, self.n):
                        for a in segment_ending[x]:
                            target = f"{self.path}.{j}." + a.target[len(template) + 1:]
                            node = g.get_attr(target)
                            node.meta = dict(a.meta)
                            env[(j, a)] = node
                continue
            if x in self.runs[template]:
                if x is first:
                    self._stamp_blocks(g, env, copy_node, shifted)
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

    def _attr_segments(self, block: str) -> dict[fx.Node, list[fx.Node]]:
        """The block's get_attrs in runs of neighbours (export lists every block's parameters,
        then every block's buffers), keyed by the last of each run."""
        segments, current = {}, []
        for x in self.cap.gm.graph.nodes:
            if x.op == "get_attr" and x.target.startswith(block + "."):
                current.append(x)
            elif current:
                segments[current[-1]], current = current, []
        if current:
            segments[current[-1]] = current
        return segments

    def _stamp_blocks(self, g, env, copy_node, shifted):
        template, middle = self.runs[self.blocks[2]], self.runs[self.blocks[1]]
        position = {x: k for k, x in enumerate(middle)}
        for j in range(2, self.n):
            for k, x in enumerate(template):
                mapping = {}
                for a in x.all_input_nodes:
                    if (j, a) in env:                    # this block's node or weight
                        mapping[a] = env[(j, a)]
                    elif a in middle and j > 2:          # the previous block's output
                        mapping[a] = env[(j - 1, template[position[a]])]
                    else:
                        mapping[a] = env[a]
                env[(j, x)] = copy_node(x, mapping, shifted(x, j - 2), f"{self.path}.{j}")


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
    when its blocks are identical (see the module docstring); the same Capture either way."""
    found = _block_list(model)
    if found is None:
        return capture(model, example_inputs, example_kwargs, **kwargs)
    path, blocks = found
    signature = _signature(blocks[1])
    if signature is None or any(_signature(b) != signature for b in list(blocks)[2:]):
        return capture(model, example_inputs, example_kwargs, **kwargs)
    short = capture(_truncated(model, path, blocks), example_inputs, example_kwargs, **kwargs)
    stamper = _Stamper(short, path, len(blocks))
    if not stamper.usable():
        return capture(model, example_inputs, example_kwargs, **kwargs)
    gm = _module(model, short, stamper.graph())
    gm.graph.lint()  # GraphModule() has generated its code
    gm.meta[REUSED] = (path, len(blocks))  # not a note: the plan must equal a whole capture's
    aliases, params, trainable = attribute_info(gm, model)
    return replace(short, gm=gm, aliases=aliases, params=params, trainable=trainable,
                   subclass_parts=subclass_parts(model, gm))
