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
from tpcompile.check import compare, rel_err

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


# --------------------------------------------------------------------------- torch.compile
# One spawn per world size runs every compile check (test_compile.py): compiling costs seconds
# per graph on 2 cores, so the models are tiny and each graph is compiled once.

def tiny(name: str) -> nn.Module:
    return models.build(name, n_layers=1, dim=32, hidden=64, n_heads=4, n_kv_heads=2)


class Branchy(nn.Module):
    """Linear -> GELU -> Linear with a Python `if` on a tensor's value in between."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        if h.sum() > 0:  # data-dependent: Dynamo splits the fc1 -> fc2 chain here
            h = h * 2
        return self.fc2(h)


class BackendView:
    """What ``compare`` needs of a model compiled with the backend: calls go through the
    compiled model, everything else (full_grads, parameters, ...) to the TPModule swapped in."""

    def __init__(self, step, model):
        self.step, self.model = step, model

    def __call__(self, *args):
        return self.step(*args)

    def __getattr__(self, name):
        return getattr(tpcompile.parallelized(self.model), name)


def _phases(codes: list[str]) -> dict:
    from tpcompile.inductor import collectives_in_code

    fw = [c for c in codes if "tangents_" not in c]
    bw = [c for c in codes if "tangents_" in c]
    return {"n_codes": len(codes), "forward": collectives_in_code(fw[0]) if fw else None,
            "backward": collectives_in_code(bw[0]) if bw else None,
            "in_flight": matmuls_in_flight(bw[0]) if bw else []}


def matmuls_in_flight(code: str) -> list[int]:
    """Per collective of a generated module: matmuls issued before its result is waited for."""
    out, open_ = [], []
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("torch.ops._c10d_functional.wait_tensor"):
            if open_:
                out.append(open_.pop(0))
        elif line.startswith("torch.ops._c10d_functional."):
            open_.append(0)
        elif line.startswith(("extern_kernels.mm(", "extern_kernels.addmm(", "extern_kernels.bmm(")):
            open_ = [n + 1 for n in open_]
    return out


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _calls_at_shapes(step, model, shapes) -> dict:
    """(batch, seq) -> (error vs the unsharded model, graphs compiled by that call)."""
    out = {}
    for b, s in shapes:
        x = models.example_inputs(model, b, s, seed=b * 100 + s)
        before = _graphs()
        y = step(*x)
        out[(b, s)] = (rel_err(y, model(*x)), _graphs() - before)
    return out


def _comparison(result) -> dict:
    return {"output_err": result.output_err, "grad_errs": result.grad_errs,
            "step_errs": result.step_errs, "planned": result.collectives}


def _compiled_tp(name: str, dynamic: bool, overlap: bool | None) -> dict:
    """Path 1: torch.compile(parallelize(model), fullgraph=True): code, shapes, 3 AdamW steps.

    With ``dynamic`` the first call's dims are marked: other batch sizes and sequence lengths
    reuse its graph. Without, repeated calls at the compiled shape reuse it.
    """
    from torch._inductor.utils import run_and_get_code

    model = tiny(name)
    inputs = models.example_inputs(model, 2, 8)
    tp = tpcompile.parallelize(model, inputs)
    if dynamic:
        tpcompile.mark_dynamic(tp, *inputs)
    step = torch.compile(tp, fullgraph=True, options=tpcompile.compile_options(overlap))
    _, codes = run_and_get_code(compare, model, step, inputs)
    shapes = [(2, 8), (3, 8), (2, 12), (4, 16), (1, 8), (1, 5)] if dynamic else [(2, 8), (2, 8)]
    out = {**_phases(codes), "calls": _calls_at_shapes(step, model, shapes)}
    tp.zero_grad()
    return {**out, **_comparison(compare(model, step, inputs, steps=3))}


def _compiled_by_backend(name: str, backend) -> dict:
    """Path 2: torch.compile(model, backend=...): first call exact, then 3 AdamW steps."""
    import copy
    import gc
    import weakref

    from torch._inductor.utils import run_and_get_code

    model = tiny(name)
    reference = copy.deepcopy(model)
    inputs = models.example_inputs(model, 2, 8)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    originals = [weakref.ref(p) for p in model.parameters()]
    graphs = _graphs()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # built too early: must refuse to step
    step = torch.compile(model, backend=backend)
    first = step(*inputs)
    first.float().pow(2).sum().backward()
    try:
        stale.step()
        refused = "stepped"
    except tpcompile.TPCompileError as e:
        refused = str(e)
    ref = reference(*inputs)
    ref.float().pow(2).sum().backward()
    tp = tpcompile.parallelized(model)
    grads = tp.full_grads()
    first_errs = {"output": rel_err(first, ref)}
    first_errs.update({n: rel_err(grads[n], p.grad) for n, p in reference.named_parameters()})
    model.zero_grad()
    reference.zero_grad()
    del stale
    gc.collect()
    result, codes = run_and_get_code(compare, reference, BackendView(step, model), inputs, 3)
    local = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    planned = {n: p.local_shapes[tp.rank] for n, p in tp.plan.params.items()
               if n in dict(model.named_parameters())}
    return {**_comparison(result), **_phases(codes), "first_errs": first_errs,
            "graphs": _graphs() - graphs, "param_bytes": sum(local.values()),
            "planned_bytes": sum(math.prod(s) * 4 for s in planned.values()),
            "full_bytes": full_bytes, "originals_alive": sum(r() is not None for r in originals),
            "stale_optimizer": refused,
            "report": [str(r) for r in backend_report(backend)]}


def backend_report(backend):
    from tpcompile.dynamo_backend import tpcompile_backend

    return (tpcompile_backend if backend == "tpcompile" else backend).report


def _graph_break(backend) -> dict:
    """A chain split by a graph break runs replicated and exact; the report says why."""
    import copy

    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    step = torch.compile(model, backend=backend)
    errs = {}
    for i in range(2):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i))
        out, ref = step(x), reference(x)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        errs[f"output_{i}"] = rel_err(out, ref)
    errs.update({n: rel_err(p.grad, r.grad) for (n, p), r in
                 zip(model.named_parameters(), reference.parameters())})
    return {"errs": errs, "shapes_kept": {n: tuple(p.shape) for n, p in model.named_parameters()} == full,
            "parallelized": tpcompile.parallelized(model) is not None,
            "report": [str(r) for r in backend_report(backend) if r.module == "Branchy"]}


def compiled(rank: int, world_size: int, names: list[str], dynamic: str | None) -> dict:
    """Every compile check for one world size; ``dynamic``: the model compiled with marked dims."""
    from torch.distributed.device_mesh import init_device_mesh

    # path 1 compiles the static graphs the backend compiles later with the same options
    # (OVERLAP_DEFAULT is off), so the backend's come from inductor's FX graph cache
    jobs = {f"tp_{n}": (_compiled_tp, n, False, False) for n in names}
    if dynamic:
        jobs["tp_dynamic"] = (_compiled_tp, dynamic, True, True)
    # the mlp through a configured backend object, the others through the registered name
    configured = tpcompile.backend(mesh=init_device_mesh("cpu", (world_size,)))
    jobs.update({f"backend_{n}": (_compiled_by_backend, n, configured if n == "mlp" else "tpcompile")
                 for n in names})
    jobs["graph_break"] = (_graph_break, "tpcompile")
    out = {}
    for key, (fn, *args) in jobs.items():
        try:
            out[key] = fn(*args)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[key] = {"error": traceback.format_exc()}
    return out
