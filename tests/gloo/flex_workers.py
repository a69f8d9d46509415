"""Rank-side bodies of ``test_flex_attention.py``: flex attention blocks on gloo ranks.

Each case parallelizes a block of ``zoo/flex_models.py`` written with ``flex_attention`` and
compares it with the same weights computing the same attention in plain tensor ops (the
reference CPU can differentiate): the output and every gradient. A case whose block mask is a
call input is then called with a mask of another ``mask_mod``: what the module says.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask

import tpcompile
from tpcompile.core.capture import capture
from tpcompile.runtime.collectives import count_collectives
from tpcompile.tools.numerics import _loss, compare, grad_errors, rel_err
from zoo import flex_models


def flex_cases(rank: int, world_size: int, names: list[str]) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in names:
        try:
            model, inputs = flex_models.build(name)
            reference, _ = flex_models.build(name, math_impl=True)
            tp = tpcompile.parallelize(model, inputs)
            c = compare(reference, tp, inputs)
            out[name] = {"output_err": c.output_err, "grad_errs": c.grad_errs,
                         "collectives": c.collectives, "other_mask": _other_mask(tp, inputs),
                         "sharded": sorted(n for n, p in tp.plan.params.items()
                                           if p.local_shapes[rank] != p.global_shape)}
        except Exception:  # noqa: BLE001 - returned to the test, which fails with it
            out[name] = {"error": traceback.format_exc()[-3000:]}
    return out


def _other_mask(tp, inputs) -> str:
    """The error a call with a block mask of another ``mask_mod`` raises ('' if it ran)."""
    if len(inputs) < 2:
        return "no mask input"
    seq = inputs[0].shape[1]
    mask = create_block_mask(flex_models.local_window, None, None, seq, seq, device="cpu")
    try:
        with torch.no_grad():
            tp(inputs[0], mask)
    except Exception as e:  # noqa: BLE001 - what the call says is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return ""


def titan_cases(rank: int, world_size: int, kinds: list[str]) -> dict:
    """torchtitan 0.3's debug models: the forward against the unsharded model (under
    ``no_grad``: torch refuses its flex attention's backward on CPU), every gradient against
    the unsharded captured graph (the higher-order op's dense backward runs on CPU)."""
    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        try:
            model, inputs, kwargs = flex_models.torchtitan(kind)
            tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs)
            with torch.no_grad():
                output_err = rel_err(tp(*inputs, **kwargs), model(*inputs, **kwargs))
            whole = capture(model, inputs, kwargs).gm
            _loss(whole(*inputs, **kwargs)).backward()
            _loss(tp(*inputs, **kwargs)).backward()
            reference = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
            out[kind] = {"output_err": output_err,
                         "grad_errs": grad_errors(tp.full_grads(), reference),
                         "sharded": sum(p.local_shapes[rank] != p.global_shape
                                        for p in tp.plan.params.values()),
                         "params": len(tp.plan.params)}
        except Exception:  # noqa: BLE001 - returned to the test, which fails with it
            out[kind] = {"error": traceback.format_exc()[-3000:]}
    return out


def varlen_cases(rank: int, world_size: int, kv_heads: list[int]) -> dict:
    """Varlen attention blocks (8 query heads over each of ``kv_heads``) with the math CPU
    kernel registered: the forward against the unsharded block under ``no_grad`` (torch's
    varlen backward runs only on CUDA), the sharded weights and the collectives."""
    torch.set_num_threads(1)
    flex_models.register_varlen_math()
    out = {}
    for kv in kv_heads:
        try:
            model, inputs = flex_models.varlen(kv)
            with torch.no_grad():
                tp = tpcompile.parallelize(model, inputs)
                out[kv] = {"output_err": rel_err(tp(*inputs), model(*inputs)),
                           "collectives": count_collectives(tp.graph_module),
                           "sharded": sorted(n for n, p in tp.plan.params.items()
                                             if p.local_shapes[rank] != p.global_shape)}
        except Exception:  # noqa: BLE001 - returned to the test, which fails with it
            out[kv] = {"error": traceback.format_exc()[-3000:]}
    return out


def titan_fsdp_tp(rank: int, world_size: int, kind: str, steps: int) -> dict:
    """torchtitan 0.3's ``kind`` debug model as torchtitan trains it, with tpcompile's plan for
    its hand TP plan: a (dp 2, tp world/2) mesh, the model parallelized over ``tp``, FSDP2 over
    ``dp`` on each block and the root, each dp rank on its half of the batch (its own document
    mask), AdamW. Per step, the global loss; and the same steps of the unsharded captured
    graph (the reference CPU can train: torch refuses flex attention's own backward on CPU) on
    the whole batch."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    model, (tokens,), _ = flex_models.torchtitan(kind)
    vocab = model.config.vocab_size

    def loss_of(logits, ids):
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))

    def masks(ids):
        return {"attention_masks": model.get_attention_masks(
            torch.arange(ids.shape[1]).repeat(ids.shape[0], 1))}

    mine = tokens.chunk(2)[mesh["dp"].get_local_rank()]
    whole = capture(model, (tokens,), masks(tokens)).gm
    tp = tpcompile.parallelize(model, (mine,), example_kwargs=masks(mine), mesh=mesh["tp"])
    tpcompile.fully_shard_blocks(tp, mesh["dp"])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (tp, whole)]
    losses = []
    for _ in range(steps):
        loss = loss_of(tp(mine, **masks(mine)), mine)
        reference = loss_of(whole(tokens, **masks(tokens)), tokens)
        for opt, lo in zip(opts, (loss, reference)):
            opt.zero_grad()
            lo.backward()
            opt.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append((loss.item() / 2, reference.item()))
    return {"losses": losses}
