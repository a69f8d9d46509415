"""Rank-side bodies of the reliability tests (tests/gloo/test_reliability.py).

``reliability`` runs, in one process group per world size, every random model spec drawn by
the parent, every catalogue model, and (at 2 ranks) the contracts of ``parallelize``.
``failures`` breaks parallelize on purpose: ranks that plan differently, a rank that cannot
plan (call-time failures are tests/gloo/chaos_workers.py). Results are plain data; errors are returned
as strings so one spawn serves many checks.
"""

from __future__ import annotations

import copy
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.tools import models
from tpcompile.tools.numerics import compare, rel_err
from zoo import catalogue_models, random_models


def numerics(model, tp, x) -> dict:
    """Output and gradient errors against the unsharded model (outputs only without params)."""
    if not any(p.requires_grad for p in model.parameters()):
        return {"output_err": rel_err(tp(*x), model(*x)), "grad_errs": {}}
    c = compare(model, tp, x)
    return {"output_err": c.output_err, "grad_errs": c.grad_errs}


def _spec(spec: dict) -> dict:
    model, x = random_models.build(spec)
    try:
        tp = tpcompile.parallelize(model, x, **random_models.options(spec))
    except tpcompile.TPCompileError as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    return {**numerics(model, tp, x), "styles": sorted(set(tp.plan.styles().values()))}


def _real(t: torch.Tensor) -> torch.Tensor:
    return (torch.view_as_real(t) if t.is_complex() else t).double()


def _catalogue(name: str) -> dict:
    model, x = catalogue_models.build(name)
    ref = copy.deepcopy(model)
    tp = tpcompile.parallelize(model, x)
    for _ in range(2):  # buffers updated in forward advance like the model's own
        ref(*x), tp(*x)
    full = tp.full_state_dict()  # sharded buffers (a per-feature scale) gathered
    buffer_errs = {n: rel_err(_real(full[n]), _real(b)) for n, b in ref.named_buffers()}
    return {**numerics(model, tp, x), "buffer_errs": buffer_errs, "styles": tp.plan.styles(),
            "reasons": {n: p.reason for n, p in tp.plan.params.items()}}


def _guarded(fn, arg) -> dict:
    try:
        return fn(arg)
    except Exception:  # noqa: BLE001 - an internal exception is a finding: reported as such
        return {"crash": traceback.format_exc()}


def _snapshot(model, x) -> dict:
    """Everything parallelize must leave as it was."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "ids": {k: id(v) for k, v in model.state_dict(keep_vars=True).items()},
        "flags": {k: (p.requires_grad, p.grad is None) for k, p in model.named_parameters()},
        "modules": {k: (m.training, sorted(m.__dict__), len(m._forward_hooks),
                        len(m._forward_pre_hooks)) for k, m in model.named_modules()},
        "inputs": [t.clone() for t in x], "input_flags": [t.requires_grad for t in x],
    }


def _unchanged(model, x, before: dict) -> list[str]:
    after = _snapshot(model, x)
    changed = [k for k in ("ids", "flags", "modules", "input_flags") if after[k] != before[k]]
    changed += [f"state {k}" for k, v in after["state"].items() if not torch.equal(v, before["state"][k])]
    changed += [f"input {i}" for i, (a, b) in enumerate(zip(after["inputs"], before["inputs"]))
                if not torch.equal(a, b)]
    return changed


def contracts(world_size: int) -> dict:
    """parallelize twice, on its own result, after failures; nothing the caller passed changes."""
    out = {}
    model = models.build("gpt2")
    x = models.example_inputs(model)
    before = _snapshot(model, x)
    first, second = tpcompile.parallelize(model, x), tpcompile.parallelize(model, x)
    out["twice_same_plan"] = first.plan.to_json() == second.plan.to_json()
    out["twice_same_shards"] = all(torch.equal(a, b) for a, b in zip(
        first.state_dict().values(), second.state_dict().values()))
    out["twice_numerics"] = numerics(model, second, x)
    out["changed_by_success"] = _unchanged(model, x, before)
    try:
        tpcompile.parallelize(first, x)
        out["on_tpmodule"] = "no error"
    except tpcompile.TPCompileError as e:
        out["on_tpmodule"] = str(e)
    for name, cls in (("custom_function", catalogue_models.CustomFunction),
                      ("python_counter", catalogue_models.PythonCounter)):
        torch.manual_seed(0)
        bad, xb = cls(), (torch.randn(2, 3, catalogue_models.D),)
        pristine, before = copy.deepcopy(bad), _snapshot(bad, xb)
        try:
            tpcompile.parallelize(bad, xb)
            out[name] = {"error": "no error"}
        except tpcompile.TPCompileError as e:
            changed = _unchanged(bad, xb, before)
            y, y_ref = bad(*xb), pristine(*xb)  # still usable, and the same model
            y.sum().backward()
            y_ref.sum().backward()
            out[name] = {"error": str(e), "changed": changed,
                         "still_usable": torch.equal(y, y_ref) and all(
                             torch.equal(p.grad, q.grad) for p, q in zip(
                                 bad.parameters(), pristine.parameters()))}
    torch.manual_seed(0)
    emb = catalogue_models.Embedder(vocab=16)
    ids = torch.randint(0, 16, (2, 5))
    tp = tpcompile.parallelize(emb, (ids,), vocab_parallel=True)
    out["vocab_style"] = tp.plan.styles()["emb.weight"]
    out["vocab_numerics"] = numerics(emb, tp, (ids,))
    for label, bad_ids in (("id_too_large", ids.clone().fill_(16)), ("id_negative", -ids - 1)):
        try:
            tp(bad_ids)
            out[label] = "no error"
        except tpcompile.TPCompileError as e:
            out[label] = str(e)
    return out


def reliability(rank: int, world_size: int, specs: list[dict], names: list[str],
                with_contracts: bool) -> dict:
    out = {"specs": [_guarded(_spec, s) for s in specs],
           "catalogue": {n: _guarded(_catalogue, n) for n in names}}
    if with_contracts:
        out["contracts"] = _guarded(contracts, world_size)
    return out


# ----------------------------------------------------------------- failures on purpose

def _mismatch(rank: int, build) -> str:
    try:
        build(rank)
        return "no error"
    except tpcompile.TPCompileError as e:
        return f"{type(e).__name__}: {e}"


def _other_hidden(rank):
    model = models.build("mlp", hidden=128 if rank == 0 else 96)
    tpcompile.parallelize(model, models.example_inputs(model))


def _other_options(rank):
    model = models.build("gpt2", vocab=97)
    tpcompile.parallelize(model, models.example_inputs(model), vocab_parallel=rank == 1)


def _one_rank_fails(rank):
    torch.manual_seed(0)
    cls = catalogue_models.CustomFunction if rank == 1 else catalogue_models.MLP
    tpcompile.parallelize(cls(), (torch.randn(2, 3, catalogue_models.D),))


def _other_collectives(rank):
    """Same plan, but rank 1's rewrite turns its all-reduces into no-ops: only the rewritten
    graphs' collective sequences differ."""
    from tpcompile.passes import pipeline
    from tpcompile.runtime import collectives

    original = pipeline.rewrite_passes

    def tampered(plan, r, group, *rest):
        def drop_all_reduces(gm):
            for node in gm.graph.nodes:
                if node.target is collectives.all_reduce:
                    node.target = collectives.copy_into_chain
            return gm
        return original(plan, r, group, *rest) + [("tamper", drop_all_reduces)] * (rank == 1)

    pipeline.rewrite_passes = tampered
    try:
        model = models.build("mlp")
        tpcompile.parallelize(model, models.example_inputs(model))
    finally:
        pipeline.rewrite_passes = original


def failures(rank: int, world_size: int) -> dict:
    """Mismatches at parallelize on the world group, other weights, a long timeout."""
    out = {name: _mismatch(rank, fn) for name, fn in (
        ("other_hidden", _other_hidden), ("other_options", _other_options),
        ("one_rank_fails", _one_rank_fails), ("other_collectives", _other_collectives))}
    torch.manual_seed(rank)  # forgot to seed alike: every rank initialises other weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tpcompile.parallelize(catalogue_models.MLP(), (torch.randn(2, 3, catalogue_models.D),))
    out["other_weights_warning"] = [str(w.message) for w in caught if "weights" in str(w.message)]
    model = models.build("mlp")
    x = models.example_inputs(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tpcompile.parallelize(model, x, mesh=dist.new_group(timeout=timedelta(hours=2)))
    out["long_timeout_warning"] = [str(w.message) for w in caught if "timeout" in str(w.message)]
    return out
