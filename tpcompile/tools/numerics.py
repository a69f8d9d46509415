"""Numerical check of a tensor-parallel module against the unsharded model it came from.

Used by ``tpcompile demo`` and the test suite. Call it on every rank (it gathers shards).
Errors are relative: ``max|sharded - reference| / max|reference|`` per tensor, except that a
gradient is never measured against less than 1e-3 of the model's largest gradient.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from tpcompile.inspect.advise.retained import LiveStorages, storage_keys
from tpcompile.runtime.collectives import count_collectives

__all__ = ["Comparison", "compare", "grad_errors", "rel_err", "saved_activation_bytes",
           "activation_memory"]


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)``; 0 for two empty tensors (a parameter with no
    elements, as tiny configs make: an MLP of hidden size 0)."""
    a, b = a.detach().double(), b.detach().double()
    if not b.numel():
        return 0.0 if a.shape == b.shape else float("inf")
    scale = max(b.abs().max().item(), floor)
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def grad_errors(grads: dict, reference: dict) -> dict[str, float]:
    """Relative error of each gradient in ``reference`` (name -> tensor). A gradient that is zero
    in exact arithmetic (a key bias: softmax is shift-invariant) is measured against 1e-3 of the
    model's largest gradient instead of its own rounding noise."""
    floor = 1e-3 * max((g.abs().max().item() for g in reference.values() if g.numel()),
                       default=0.0)
    return {n: rel_err(grads[n], g, floor) for n, g in reference.items()}


def _first(out) -> torch.Tensor:
    """The first floating tensor of a model's output (tuples, dicts, HF ModelOutputs)."""
    return next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _probe(shape, device) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1234)).to(device)


def _loss(out) -> torch.Tensor:
    """A fixed random projection of the output: every output element gets its own, non-zero
    gradient. (A sum of squares is degenerate after a LayerNorm, whose outputs have a fixed
    norm: its gradient would be pure rounding noise.)"""
    y = _first(out).float()
    return (y * _probe(y.shape, y.device)).sum()


def sharded_output_losses(tp) -> tuple[Callable, Callable]:
    """``compare``'s ``losses`` for a ``loss_parallel`` module whose first output is this
    rank's shard (logits cut by vocabulary): the reference's is the projection ``compare``
    uses, ``tp``'s the same projection of its shard summed over the ranks (all-reduced forward,
    the whole gradient passed back), so both are one value with one gradient in exact
    arithmetic. (A cross-entropy's gradient cancels over the vocabulary: LayerNorm biases
    before a tied head get rounding noise that Adam's steps then amplify.)"""
    from tpcompile.runtime.collectives import all_reduce

    placement = tp.plan.outputs[0]
    ranges = tp.plan.specs.ranges(placement.layout)[tp.rank]

    def sharded(out) -> torch.Tensor:
        y = _first(out).float()
        full = list(y.shape)
        full[placement.dim] = placement.layout.size
        probe = _probe(full, y.device)
        mine = torch.cat([probe.narrow(placement.dim, s, e - s) for s, e in ranges],
                         placement.dim)
        return all_reduce((y * mine).sum(), tp.group.group_name)
    return _loss, sharded


@dataclass
class Comparison:
    output_err: float
    grad_errs: dict[str, float]
    step_errs: dict[str, float] = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    # with ``keep_state``, after ``steps``: the sharded module's gathered state and the trained
    # reference copy, for checks of weights derived from several tensors (LoRA's merged
    # base + B @ A * scale); empty otherwise, so a rank's result stays small and picklable
    full_state: dict = field(default_factory=dict)
    reference: nn.Module | None = None

    @property
    def max_grad_err(self) -> float:
        return max(self.grad_errs.values(), default=0.0)

    @property
    def max_step_err(self) -> float:
        return max(self.step_errs.values(), default=0.0)


def compare(model: nn.Module, tp: nn.Module, inputs: tuple, steps: int = 0, lr: float = 1e-3,
            kwargs: dict | None = None, keep_state: bool = False,
            losses: tuple[Callable, Callable] | None = None, *,
            copy_model: bool = True) -> Comparison:
    """Forward + backward both models on ``inputs``; optionally ``steps`` AdamW steps on both.

    ``losses``: (the reference's, ``tp``'s), each an output -> scalar, in place of a fixed
    random projection of the first output; the output error is then the loss's (a
    ``loss_parallel`` module's logits are its vocabulary shard, not comparable whole).

    ``model`` is copied first, so the caller's model is left as it was (``copy_model=False``:
    used as it is, for a reference made for this call that ``deepcopy`` cannot copy, such as a
    captured graph holding flex attention's mods). After the steps,
    parameters are compared where the reference gradient is not zero in exact arithmetic: a
    key bias gets no gradient (softmax is shift-invariant) and Adam turns the ~1e-8 rounding
    noise it gets instead into full +-lr steps, in the sharded and the unsharded run alike.
    Entries whose first gradient is below 1e-6 of their tensor's largest are left out of
    ``step_errs`` (their gradients are still compared in ``grad_errs``).
    """
    ref = copy.deepcopy(model) if copy_model else model
    kwargs = kwargs or {}
    loss_fns = losses or (_loss, _loss)
    # both calls draw the same random numbers (a DiT's class-label dropout in train mode)
    rng = torch.random.get_rng_state()
    out_ref = ref(*inputs, **kwargs)
    torch.random.set_rng_state(rng)
    out = tp(*inputs, **kwargs)
    loss_ref, loss = loss_fns[0](out_ref), loss_fns[1](out)
    out_err = rel_err(loss, loss_ref) if losses else rel_err(_first(out), _first(out_ref))
    loss_ref.backward()
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads = tp.full_grads()
    grad_errs = grad_errors(grads, ref_grads)
    missing = set(ref_grads) - set(grads)
    if missing:
        raise AssertionError(f"parameters with a reference gradient but none sharded: {sorted(missing)}")
    step_errs, full = {}, {}
    if steps:
        live = {n: g.abs() > 1e-6 * g.abs().max() for n, g in ref_grads.items()}
        opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (ref, tp)]
        for i in range(steps):
            if i:
                rng = torch.random.get_rng_state()
                for m, loss_fn in zip((ref, tp), loss_fns):
                    torch.random.set_rng_state(rng)
                    m.zero_grad()
                    loss_fn(m(*inputs, **kwargs)).backward()
            for o in opts:
                o.step()
        full = tp.full_state_dict()
        step_errs = {n: rel_err(full[n][live[n]], t[live[n]]) if n in live else rel_err(full[n], t)
                     for n, t in ref.state_dict().items() if t.is_floating_point()}
    kept = (full, ref) if keep_state else ({}, None)
    return Comparison(out_err, grad_errs, step_errs, count_collectives(tp.graph_module), *kept)


def _parameter_storages(module: nn.Module) -> set[int]:
    """The storages of ``module``'s parameters (a DTensor's: its local tensor's)."""
    return {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in module.parameters()}


def saved_activation_bytes(module: nn.Module, inputs: tuple) -> int:
    """Bytes autograd keeps for backward after one forward of ``module`` (parameters excluded).

    Each distinct storage is counted once; the backward is run too, so that only tensors it
    really reads count (``saved_tensors_hooks`` sees every save). The parameters are read at
    each save: under FSDP2 they are the gathered, unsharded tensors during the forward.
    """
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in _parameter_storages(module):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    _first(out).float().sum().backward()
    return sum(seen.values())


def activation_memory(module: nn.Module, inputs: tuple) -> tuple[int, int]:
    """``(held, peak)`` bytes of the tensors ops allocate in one forward and backward of
    ``module`` (parameters and inputs left out).

    *held*: still alive when the forward returns: what autograd saves for backward, what a
    selective checkpoint keeps in its own cache (which :func:`saved_activation_bytes` cannot
    see), and the output. *peak*: the most alive at once over the forward and the backward,
    temporaries, recomputations and the gradients included. Tracks storages through a
    ``TorchDispatchMode`` (:class:`~tpcompile.inspect.advise.retained.LiveStorages`, which
    ``advise`` estimates with too), so it works on CPU, where no allocator reports a peak.
    """
    module.zero_grad(set_to_none=True)  # the gradients are allocated, and counted, anew
    skip = storage_keys([*module.parameters(), *tree_leaves(inputs)])
    with LiveStorages(skip) as mode:
        out = module(*inputs)
        held = mode.alive()
        _first(out).float().sum().backward()
    return held, mode.peak
