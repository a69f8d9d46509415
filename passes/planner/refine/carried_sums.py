"""Carried sums: a residual added to row-parallel outputs rides in their partial sum, reduced once.

Cohere's blocks and litgpt's ``parallel_residual`` ones (pythia, phi-2, Falcon) run attention
and the MLP side by side and add both to the residual stream in one expression, where each
row-parallel output meets a replicated value before it meets the other. Cohere writes
``x + attn(h) + mlp(h)``, the residual first: export gives ``add(add(x, o), d)``, where ``o``
and ``d`` are the partial sums of the row-parallel ``o_proj`` and ``down_proj`` and ``x`` is
replicated; litgpt writes ``mlp(h2) + attn(h1) + x`` with a bias on each projection, added to
its partial sum first (``split_bias``). A partial sum plus a replicated value is no partial
sum (every rank would add ``x``), so the rule table reduces ``o`` at the first ``add`` and
``d`` at the second: two forward all-reduces where Megatron pays one for the block.

Here the planner finds such *sum trees*: ``add`` / ``sub`` nodes (rule field ``sums``), each
read by nothing but the next sum of the tree, their operands replicated or partial. When the
tree sums at least two partial sums that nothing outside it reads reduced (each would cost its
own all-reduce), its sums are *carried* (``Constraints.carried``): the rule reads each
replicated operand as rank 0's share of the partial sum, a ``summand`` conversion
(``Conversion.kind``) that the rewrite turns into ``zero_summand``: rank 0 keeps the value,
every other rank adds zeros. The tree's output is then one partial sum, reduced once by
whoever reads it whole (the next layer's norm): one all-reduce instead of one per partial sum.
That all-reduce is taken where the tree ends (the top is reduced early, for every reader that
does not add it into a sum of its own): carried on through the ops linear in it (Cohere's
LayerNorm casts it and subtracts its mean before it squares), the partial sum would reach
a norm's statistics and make the next block's chains pay for it.
GPT-J, CodeGen, GPT-NeoX and Phi drop each branch out before the sum
(``dropout(attn(h)) + dropout(mlp(h)) + x``, the MLP's bias added first): the tree reaches
through the ops that pass a sum on (rule field ``scales``: dropout, whose mask every rank
draws alike, floating casts, products with a number) to the sums below them.
A tree with one partial sum (Llama's sequential ``x + attn(norm(x))``) saves nothing and is
left as it is; so is a partial sum that another reader reduces anyway (it costs its
all-reduce either way). The replicated value itself is untouched for its other readers (its
norm, the next residual): only its contribution to the sum is zero on ranks other than 0.

Gradients: a partial sum's gradient is whole on every rank (the all-reduce that ends it, *g*,
passes the gradient through), and so is the replicated operand's: ``zero_summand``'s backward
is the identity on every rank, not the derivative of a multiplication by zero. ``x``'s
gradient through the sum is therefore whole everywhere, as it was through the all-reduce, and
needs no gradient sync (the conversion's destination is no shard, which is what
:mod:`tpcompile.passes.planner.grad_syncs` asks).

Not under sequence parallelism: there the residual stream is cut by position and each
row-parallel output reduce-scattered into it, so a replicated operand does not occur; such
plans are left exactly as they were.
"""

from __future__ import annotations

import torch
from torch import fx

from tpcompile.core.placement import Partial, Replicate
from tpcompile.passes.planner.dims import val
from tpcompile.passes.planner.propagate import Constraints, Propagation
from tpcompile.passes.planner.reads import consumed
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.rules import is_sum, scales

__all__ = ["carried_sums"]

# partial sums a tree must sum, each otherwise all-reduced on its own, for carrying it to pay:
# the tree's output costs one all-reduce itself
WORTH = 2


def carried_sums(gm: fx.GraphModule, state: Propagation, constraints: Constraints) -> Decision:
    """Carry the sum nodes whose replicated operands should enter their partial sums as rank
    0's share, in every tree where that saves all-reduces (see the module docstring), and
    reduce the tops of those trees early, each where it is made. The sums carried already
    (``constraints.carried``) no longer show a replicated operand."""
    if constraints.options.sequence_parallel or state.specs.world_size < 2:
        return Decision()
    sums: set[str] = set()
    tops: set[str] = set()
    for top in gm.graph.nodes:
        if not _summable(state, top) or _in_tree(state, top):
            continue
        tree = _tree(state, top)
        if _saved(state, tree, constraints.carried) >= WORTH:
            sums.update(n.name for n in tree if _replicated_operands(state, n))
            tops.add(top.name)
    return Decision(carried=sums - constraints.carried,
                    reduce_early=tops - constraints.reduce_early)


def _readers(node: fx.Node) -> list[fx.Node]:
    """The users that read ``node``'s value (export's metadata checks have none)."""
    return [u for u in node.users if val(u) is not None or u.op == "output"]


def _operands(node: fx.Node) -> list:
    """The operands a sum adds (``alpha`` and other keywords are no summands), or the one a
    scaling op passes on."""
    return list(node.args[:2]) if is_sum(node) else list(node.args[:1])


def _floating(node) -> bool:
    v = val(node) if isinstance(node, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _summable(state: Propagation, node: fx.Node) -> bool:
    """A sum of two floating tensors that are each replicated or partial as they are made,
    with a replicated or partial result: a sum the rule may carry."""
    if node.op != "call_function" or not is_sum(node) or not _floating(node):
        return False
    operands = _operands(node)
    if len(operands) != 2 or not all(_floating(a) for a in operands):
        return False  # a number added: it has no rank-0 share to give
    return all(isinstance(state.placements.get(a), (Partial, Replicate))
               for a in operands + [node])


def _passes(state: Propagation, node: fx.Node) -> bool:
    """An op that passes a carried sum on (its rule ``scales``: dropout, a floating cast),
    floating and replicated or partial as it is made."""
    return (node.op == "call_function" and scales(node) and _floating(node)
            and isinstance(state.placements.get(node), (Partial, Replicate)))


def _in_tree(state: Propagation, node: fx.Node) -> bool:
    """``node`` is a sum, or an op that passes one on, read by exactly one op, itself a sum of
    the tree or an op passing it on to one: an inner node."""
    readers = _readers(node)
    if not (_summable(state, node) or _passes(state, node)) or len(readers) != 1:
        return False
    reader = readers[0]
    if reader.op != "call_function" or node not in _operands(reader):
        return False
    return _summable(state, reader) or _in_tree(state, reader)


def _tree(state: Propagation, top: fx.Node) -> list[fx.Node]:
    """``top`` and the inner sums below it, top first."""
    tree, todo = [], [top]
    while todo:
        node = todo.pop()
        if node in tree:
            continue
        tree.append(node)
        todo.extend(a for a in _operands(node)
                    if isinstance(a, fx.Node) and _in_tree(state, a))
    return tree


def _leaves(tree: list[fx.Node]) -> list[fx.Node]:
    """The operands of the tree's sums that are not sums of the tree, each once."""
    members, out = set(tree), []
    for node in tree:
        for a in _operands(node):
            if a not in members and a not in out:
                out.append(a)
    return out


def _saved(state: Propagation, tree: list[fx.Node], carried: set[str]) -> int:
    """How many partial sums the tree adds that only it reads, each reduced on its own unless
    the tree is carried (0 when no sum of the tree mixes a replicated operand in, nor was
    carried for one: the tree is then one partial sum already)."""
    if not any(_replicated_operands(state, n) or n.name in carried for n in tree):
        return 0
    members = set(tree)
    return sum(1 for leaf in _leaves(tree)
               if isinstance(state.placements.get(leaf), Partial)
               and all(u in members or isinstance(consumed(state, leaf, u), Partial)
                       for u in _readers(leaf)))


def _replicated_operands(state: Propagation, node: fx.Node) -> list[fx.Node]:
    """The operands of a sum that are replicated as they are made (a partial sum another
    reader reduces early is not: the carried rule reads it partial); none for an op that
    passes a sum on."""
    return [a for a in _operands(node) if is_sum(node)
            and isinstance(state.placements.get(a), Replicate)]
