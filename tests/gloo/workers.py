"""Rank-side test bodies. The launcher imports this file by path in each spawned rank.

Each worker runs many cases in one process group and returns plain data per case (errors are
returned as strings, not raised), so that one spawn serves a whole parametrized test module.
"""

from __future__ import annotations

import math
import traceback

import torch
from torch import nn

import tpcompile
from tpcompile import models
from tpcompile.check import compare

class SincAttention(nn.Module):
    """Explicit attention with an op tpcompile has no rule for on the head-sharded scores."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.sinc(q @ k.transpose(-2, -1) / math.sqrt(C // self.heads))
        y = att.softmax(-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


# name -> (built-in model name or a module class, config overrides)
CASES = {
    "mlp": ("mlp", {}),
    "gpt2": ("gpt2", {}),
    "gpt2_explicit_attention": ("gpt2", {"sdpa": False}),
    "llama": ("llama", {}),
    "llama_explicit_attention": ("llama", {"sdpa": False}),
    # indivisible everything: 6 heads of 8, 2 kv heads, hidden 100, vocab 97
    "llama_uneven": ("llama", {"dim": 48, "n_heads": 6, "n_kv_heads": 2, "hidden": 100, "vocab": 97}),
    "mlp_uneven": ("mlp", {"dim": 20, "hidden": 30}),
    # the scores go through an op without a sharding rule: gathered there, still exact
    "unknown_op_fallback": (SincAttention, {}),
}


def _run_case(name: str) -> dict:
    model_name, overrides = CASES[name]
    if isinstance(model_name, str):
        model = models.build(model_name, **overrides)
        inputs = models.example_inputs(model)
    else:
        torch.manual_seed(0)
        model = model_name(**overrides)
        inputs = (torch.randn(2, 8, model.cfg.dim),)
    tp = tpcompile.parallelize(model, inputs)
    result = compare(model, tp, inputs, steps=3)
    return {
        "output_err": result.output_err,
        "grad_errs": result.grad_errs,
        "step_errs": result.step_errs,
        "collectives": result.collectives,
        "styles": tp.plan.styles(),
        "local_shapes": {n: tuple(p.shape) for n, p in tp.named_parameters()},
        "n_layers": model.cfg.n_layers,
        "fallbacks": tp.plan.fallbacks,
    }


def numerics(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = _run_case(name)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
    return out


def dynamic_shapes(rank: int, world_size: int) -> dict:
    """One parallelized module called with other batch sizes and sequence lengths."""
    model = models.build("llama")
    tp = tpcompile.parallelize(model, models.example_inputs(model, batch=2, seq=16))
    errs = {}
    for batch, seq in [(2, 16), (3, 16), (2, 24), (3, 24), (1, 5)]:
        x = models.example_inputs(model, batch=batch, seq=seq, seed=batch * 100 + seq)
        errs[(batch, seq)] = (tp(*x) - model(*x)).abs().max().item() / model(*x).abs().max().item()
    return errs


def plan_mismatch(rank: int, world_size: int) -> str:
    """Rank 1 builds a different model: every rank must raise before any model collective."""
    model = models.build("mlp", hidden=128 if rank == 0 else 96)
    try:
        tpcompile.parallelize(model, models.example_inputs(model))
    except tpcompile.PlanMismatchError as e:
        return str(e)
    return "no error"


def mesh_checks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model = models.build("mlp")
    inputs = models.example_inputs(model)
    out = {}
    mesh = init_device_mesh("cpu", (world_size,))
    tp = tpcompile.parallelize(model, inputs, mesh=mesh)
    out["mesh_1d_err"] = (tp(*inputs) - model(*inputs)).abs().max().item()
    try:
        tpcompile.parallelize(model, inputs, mesh=init_device_mesh("cpu", (2, world_size // 2)))
        out["mesh_2d"] = "no error"
    except tpcompile.MeshError as e:
        out["mesh_2d"] = str(e)
    return out


def world_size_one(rank: int, world_size: int) -> dict:
    model = models.build("llama")
    inputs = models.example_inputs(model)
    tp = tpcompile.parallelize(model, inputs)
    return {"styles": set(tp.plan.styles().values()),
            "collectives": compare(model, tp, inputs).collectives,
            "err": (tp(*inputs) - model(*inputs)).abs().max().item()}


def untouched_model(rank: int, world_size: int) -> dict:
    """parallelize leaves the model as it was and shares no storage with it."""
    model = models.build("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {t.data_ptr() for t in model.state_dict().values()}
    tp = tpcompile.parallelize(model, models.example_inputs(model))
    x = models.example_inputs(model)
    tp(*x).sum().backward()
    torch.optim.SGD(tp.parameters(), lr=0.1).step()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    shared = [n for n, t in tp.state_dict().items() if t.data_ptr() in ptrs]
    return {"changed": changed, "shared": shared, "keys_equal": set(tp.state_dict()) == set(before)}


class InferredHeadsBlock(nn.Module):
    """A Llama-style block whose views take the head count from the tensor (``-1``).

    PyTorch's ``parallelize_module`` runs the model's own code on local shards, so it can only
    shard attention written this way; tpcompile rewrites hard-coded head counts instead.
    """

    def __init__(self, dim=32, heads=4, kv_heads=2, hidden=48):
        super().__init__()
        self.head_dim, self.n_rep = dim // heads, heads // kv_heads
        self.attention_norm = models.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = models.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.n_rep, 1)
        v = self.wv(h).view(B, T, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.n_rep, 1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class InferredHeadsStack(nn.Module):
    def __init__(self, n_layers=2, dim=32):
        super().__init__()
        self.dim = dim
        self.layers = nn.ModuleList(InferredHeadsBlock(dim) for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def dtensor_case(name: str):
    """(model, example inputs) for the parallelize_module equivalence test."""
    torch.manual_seed(0)
    if name == "inferred_heads":
        model = InferredHeadsStack(n_layers=1)
        return model, (torch.randn(2, 8, model.dim),)
    model = models.build(name, n_layers=1)
    return model, models.example_inputs(model)


def dtensor_equivalence(rank: int, world_size: int, names: list[str]) -> dict:
    """explain(...).to_dtensor_plan() applied with parallelize_module vs the unsharded model."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from tpcompile.check import rel_err

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in names:
        try:
            model, inputs = dtensor_case(name)
            report = tpcompile.explain(model, inputs, world_size)
            plan = report.to_dtensor_plan()
            ref = copy.deepcopy(model)
            dt = parallelize_module(copy.deepcopy(model), mesh, plan)
            tp = tpcompile.parallelize(model, inputs)
            y_ref, y_dt = ref(*inputs), dt(*inputs)
            y_ref.pow(2).sum().backward()
            y_dt.pow(2).sum().backward()
            grads, same_shards = {}, {}
            for n, p in ref.named_parameters():
                q = dt.get_parameter(n)
                g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
                grads[n] = rel_err(g, p.grad)
                if isinstance(q, DTensor) and q.placements[0].is_shard():
                    same_shards[n] = torch.equal(q.to_local(), tp.get_parameter(n).detach())
            out[name] = {
                "plan": {m: type(s).__name__ for m, s in plan.items()},
                "not_expressible": sorted(report.not_expressible),
                "output_err": rel_err(y_dt, y_ref),
                "vs_tpcompile": rel_err(y_dt, tp(*inputs)),
                "grad_errs": grads,
                "same_shards": same_shards,
            }
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
    return out
