"""The cost rule's model: does a per-sample column -> row chain pay for its collectives?

Most chains (attention, MLPs) run on every token; their compute grows with the tokens and their
all-reduces are bandwidth-bound, so sharding them always pays at a deployment's size, however
small the example (widths of 64 and 16 tokens in the tests). A chain whose input has one row per
sample (no token dims: a timestep / class embedder MLP, an adaLN modulation on ``(batch, dim)``)
saves work that grows with the batch only, while each of its collectives pays a fixed latency.
Such a chain is judged under an alpha-beta model, per training step (forward + backward) on one
rank, at a stated deployment point of :data:`SAMPLES` samples of :data:`TOKENS` tokens each
(a value with token rows in the example has ``TOKENS`` rows per sample there, one with a row per
sample has one):

- *saved*: ``(1 - 1/N)`` of the chain's matmuls, ``3 x FLOPs / matmul rate`` (the forward and
  the two gradients), and of its weights, ``3 x bytes / memory rate`` (read once forward, twice
  backward: the memory a rank no longer holds, priced as the reads it no longer does);
- *cost*: per all-reduce (each partial sum the chain's outputs are reduced as, forward, and the
  gradient of each input that carries one, backward) ``latency + 2 (N - 1) / N x bytes /
  bandwidth``.

The chain is kept whole when the cost is not below the saving. Rates, latency and bandwidth come
from the planner's rates in the one device table (:mod:`~tpcompile.passes.planner.devices`);
``PlanOptions.chain_cost`` names the device (default ``"cuda"``: an H100-class GPU with NVLink,
where plans are deployed whatever device they are made on) or ``"off"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from tpcompile.errors import TPCompileError
from tpcompile.passes.planner.dims import shape, val
from tpcompile.passes.planner.devices import RATED, Device
from tpcompile.passes.planner.rules import is_view

__all__ = ["SAMPLES", "TOKENS", "ChainCost", "batch_of", "chain_cost", "cost_device", "operands",
           "per_sample_chain", "per_sample_rows", "pricing", "rows_of", "stored"]

SAMPLES = 8      # samples per step and rank at the deployment point
TOKENS = 4096    # tokens per sample there (a 4K context; a 1024 x 1024 image's 64 x 64 patches)


def cost_device(name: str) -> Device | None:
    """The device a plan option names, None for ``"off"``; a named refusal otherwise."""
    if name == "off":
        return None
    if name not in RATED:
        raise TPCompileError(f"chain_cost must be 'off' or a device of the planner's table "
                             f"({', '.join(sorted(RATED))}), got {name!r}")
    return RATED[name]


def _sizes(node: fx.Node) -> tuple[int | None, ...]:
    """``node``'s sizes at the example (a symbolic size's hint: no guard, so judging a chain
    never fixes a dim the capture left dynamic); None for a data-dependent size (no hint)."""
    return tuple(s if isinstance(s, int) else s.node.hint for s in shape(node))


def _numel(node: fx.Node) -> int:
    """Its elements at the example; 0 for a value with a data-dependent size (counts nothing)."""
    dims = _sizes(node)
    return 0 if None in dims else math.prod(dims)


def rows_of(node: fx.Node) -> int | None:
    """The rows of a value (a matmul's activation): every dim but the last; None for a value
    with no dims (or no tensor) or a data-dependent size."""
    dims = _sizes(node)
    return math.prod(dims[:-1]) if dims and None not in dims else None


def batch_of(gm: fx.GraphModule) -> int | None:
    """The model's batch: dim 0 of its first input with one."""
    return next((_sizes(n)[0] for n in gm.graph.find_nodes(op="placeholder") if _sizes(n)), None)


def per_sample_rows(node: fx.Node | None, batch: int | None) -> bool:
    """``node``'s value (a matmul's activation) has one row per sample (no token dims)."""
    rows = rows_of(node) if node is not None else None
    return batch is not None and rows is not None and rows <= batch


def per_sample_chain(activations, batch: int | None) -> bool:
    """What a chain the cost rule judges is: one whose column matmuls (their ``activations``)
    each read one row per sample. The planner asks it of a chain's column matmuls
    (:mod:`~tpcompile.passes.planner.refine.unpaid_chains`), Megatron's bound of one matmul
    (:mod:`tpcompile.inspect.bound.bound`)."""
    return all(per_sample_rows(a, batch) for a in activations)


def pricing(name: str, ranks: int, gm: fx.GraphModule, activations) -> tuple[Device, int] | None:
    """The device and batch chains are priced at, or None where none is judged: the rule is
    ``"off"``, there is one rank, or no matmul (of ``activations``) reads token rows, so
    nothing scales differently from the rest. A device name the table lacks is refused."""
    device, batch = cost_device(name), batch_of(gm)
    if device is None or ranks < 2 or per_sample_chain(activations, batch):
        return None
    return device, batch


def stored(node: fx.Node) -> fx.Node | None:
    """The stored tensor (``get_attr``) ``node`` is, or is a view of; None for an activation."""
    while node.op != "get_attr":
        if not is_view(node):
            return None
        node = node.args[0]
    return node


def operands(matmul: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """A matmul's activation and its largest stored operand (its weight)."""
    inputs = [a for a in matmul.all_input_nodes if isinstance(val(a), torch.Tensor)]
    weights = [w for a in inputs if (w := stored(a)) is not None]
    activation = next((a for a in inputs if stored(a) is None), None)
    return activation, max(weights, key=_numel, default=None)


def _per_sample(amount: float, node: fx.Node, batch: int) -> float:
    """``amount`` of an example value, per sample at the deployment point: a value with a row
    per sample keeps its amount per row, a value with token rows has :data:`TOKENS` of them."""
    rows = rows_of(node) or 1
    return amount / rows * (1 if rows <= batch else TOKENS)


def _bytes(node: fx.Node) -> int:
    return _numel(node) * val(node).dtype.itemsize


@dataclass(frozen=True)
class ChainCost:
    """One chain's numbers, per training step and rank at the deployment point."""

    device: str
    ranks: int
    flops: float            # the chain's matmul FLOPs, forward, whole
    weight_bytes: float     # the weights it would cut
    collective_bytes: tuple[float, ...]  # each all-reduce's bytes
    saved_s: float
    cost_s: float

    @property
    def pays(self) -> bool:
        return self.saved_s > self.cost_s

    def __str__(self) -> str:
        sent = ", ".join(f"{b / 1024:.1f} KiB" for b in self.collective_bytes)
        return (f"on {self.device} at {SAMPLES} samples of {TOKENS} tokens over {self.ranks} ranks "
                f"it saves {self.saved_s * 1e6:.2f} us a step ({self.flops / 1e6:.3g} MFLOP, "
                f"{self.weight_bytes / 1024:.1f} KiB of weights) but its "
                f"{len(self.collective_bytes)} all-reduce(s) ({sent}) cost {self.cost_s * 1e6:.2f} us")


def chain_cost(matmuls, weights, reduced, batch: int, ranks: int, device: Device) -> ChainCost:
    """The alpha-beta model of the module docstring for one chain of the example's graph: its
    ``matmuls`` (column and row), the stored ``weights`` it cuts, and the values it all-reduces
    (``reduced``: the partial sums forward, the inputs whose gradient it syncs backward), at
    the deployment point (``batch``: the example's)."""
    flops = 0.0
    for activation, weight in map(operands, matmuls):  # 2 x rows x weight: a matmul's FLOPs
        if activation is not None and weight is not None:
            rows = rows_of(activation) or 1
            flops += SAMPLES * _per_sample(2.0 * rows * _numel(weight), activation, batch)
    weight_bytes = sum(_bytes(w) for w in weights)
    cut = 1 - 1 / ranks
    saved = cut * (3 * flops / device.matmul_flops + 3 * weight_bytes / device.memory_bytes)
    sent = tuple(SAMPLES * _per_sample(_bytes(v), v, batch)
                 for v in sorted(reduced, key=lambda n: n.name))
    cost = sum(device.allreduce_s + 2 * cut * b / device.allreduce_bytes for b in sent)
    return ChainCost(device.name, ranks, flops, weight_bytes, sent, saved, cost)
