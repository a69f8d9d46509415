"""Rank-side bodies of ``test_mesh.py``: tensor parallelism inside a 2-D (dp, tp) mesh with FSDP2.

One 4-rank spawn trains the same tiny Llama at (dp 2, tp 2) and compares with one process
training the unsharded model on the global batch, checkpoints it, and reloads the checkpoint at
(dp 1, tp 4), (dp 4, tp 1) and into the unsharded model. Every check returns plain data; a check
that raises returns its traceback instead of stopping the others.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import tpcompile
from tpcompile.state import checkpoint
from tpcompile.tools import models

CFG = dict(dim=32, hidden=64, n_layers=2, vocab=64)  # 8 query / 2 KV heads: KV replicated at tp 4
BATCH, SEQ, STEPS, SAVE_AT, LR = 8, 8, 5, 3, 1e-3
MAX_NORM = 0.5  # below every step's gradient norm: clipping is active on every step


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, CFG["vocab"], (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def loss_of(logits: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, CFG["vocab"]), toks[:, 1:].reshape(-1))


def checked(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


# ---------------------------------------------------------------------------- the unsharded run
def reference(steps=range(STEPS), model=None, opt=None, bf16: bool = False):
    """One process on the global batch: (losses, grad norms, model, optimizer).

    ``bf16``: forward and backward on a bfloat16 copy of the float32 weights, gradients
    applied to the float32 weights in float32: what FSDP2's MixedPrecisionPolicy(param_dtype=
    bfloat16, reduce_dtype=float32) computes.
    """
    model = model or models.build("llama", **CFG)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in steps:
        run = copy.deepcopy(model).to(torch.bfloat16) if bf16 else model
        loss = loss_of(run(tokens(step)), tokens(step))
        opt.zero_grad()
        loss.backward()
        if bf16:
            for p, q in zip(model.parameters(), run.parameters()):
                p.grad = q.grad.float()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, model, opt


# ---------------------------------------------------------------------------- the 2-D run
def two_d(dp: int, tp_size: int, seed: int = 0, mp: MixedPrecisionPolicy | None = None):
    """The recipe of docs/scaling.md: parallelize over mesh["tp"], then FSDP2 over mesh["dp"]."""
    mesh = init_device_mesh("cpu", (dp, tp_size), mesh_dim_names=("dp", "tp"))
    model = models.build("llama", seed=seed, **CFG)
    tp = tpcompile.parallelize(model, (tokens(0)[: BATCH // dp],), mesh=mesh["tp"])
    tpcompile.fully_shard_blocks(tp, mesh["dp"], **({"mp_policy": mp} if mp else {}))
    return tp, torch.optim.AdamW(tp.parameters(), lr=LR), mesh


def train(tp, opt, mesh, steps) -> tuple[list[float], list[float]]:
    """Each dp rank its slice of the global batch; losses averaged over dp."""
    dp, k = mesh["dp"].size(), mesh["dp"].get_local_rank()
    losses, norms = [], []
    for step in steps:
        toks = tokens(step).chunk(dp)[k]
        loss = loss_of(tp(toks), toks)
        opt.zero_grad()
        loss.backward()
        norms.append(tpcompile.clip_grad_norm_(tp, MAX_NORM).item())
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        losses.append(mean.item() / dp)
    return losses, norms


def full(tp, name: str, value: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor: FSDP2's rows gathered over dp, then the tp shards over tp."""
    local = value.full_tensor() if isinstance(value, DTensor) else value
    entry = tp.plan.by_fqn.get(name)
    return tpcompile.gather_full(local, None if entry is None else entry.placement, tp.plan, tp.group)


def full_state(tp, opt) -> dict[str, torch.Tensor]:
    """Parameters and per-parameter optimizer state, unsharded, keyed 'name' / 'name:exp_avg'."""
    out = {name: full(tp, name, p.detach()) for name, p in tp.named_parameters()}
    for name, state in get_optimizer_state_dict(tp, opt)["state"].items():
        for key, value in state.items():
            out[f"{name}:{key}"] = full(tp, name, value) if value.ndim else value.clone()
    return out


def plain_state(model, opt) -> dict[str, torch.Tensor]:
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, state in get_optimizer_state_dict(model, opt)["state"].items():
        out |= {f"{name}:{key}": value.clone() for key, value in state.items()}
    return out


def unequal(got: dict, want: dict) -> list[str]:
    return sorted(k for k in set(got) | set(want)
                  if k not in got or k not in want or not torch.equal(got[k], want[k]))


# ---------------------------------------------------------------------------- the checks
def _train_and_save(ckpt: str, state: dict) -> dict:
    tp, opt, mesh = two_d(2, 2)
    losses, norms = train(tp, opt, mesh, range(SAVE_AT))
    state["saved"] = full_state(tp, opt)
    checkpoint.save(tp, ckpt, optimizer=opt)
    more, more_norms = train(tp, opt, mesh, range(SAVE_AT, STEPS))
    return {"losses": losses + more, "norms": norms + more_norms}


def _resume_at(dp: int, tp_size: int, ckpt: str, state: dict) -> dict:
    tp, opt, mesh = two_d(dp, tp_size, seed=1)  # other values: the checkpoint must replace them
    checkpoint.load(tp, ckpt, optimizer=opt)
    loaded = unequal(full_state(tp, opt), state["saved"])
    losses, _ = train(tp, opt, mesh, range(SAVE_AT, STEPS))
    return {"unequal": loaded, "losses": losses}


def _into_unsharded(ckpt: str, state: dict) -> dict:
    model = models.build("llama", seed=1, **CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tree = dict(model.state_dict(), optimizer=get_optimizer_state_dict(model, opt))
    dcp.load(tree, checkpoint_id=ckpt, no_dist=True)
    set_optimizer_state_dict(model, opt, tree["optimizer"])
    loaded = unequal(plain_state(model, opt), state["saved"])
    losses, _, _, _ = reference(range(SAVE_AT, STEPS), model, opt)
    return {"unequal": loaded, "losses": losses}


def _mixed_precision(steps: int = STEPS) -> dict:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tp, opt, mesh = two_d(2, 2, mp=mp)
    dtypes = sorted({str(p.dtype) for p in tp.parameters()})
    logits_dtype = str(tp(tokens(0).chunk(2)[0]).dtype)
    losses, _ = train(tp, opt, mesh, range(steps))
    return {"losses": losses, "param_dtypes": dtypes, "logits_dtype": logits_dtype,
            "bf16_reference": reference(range(steps), bf16=True)[0]}


def mixed_precision(rank: int, world_size: int, steps: int) -> dict:
    """Only the mixed-precision check, over ``steps`` steps (``test_mesh``'s slow variant)."""
    return checked(_mixed_precision, steps)


def fsdp_tp(rank: int, world_size: int, tmp: str) -> dict:
    ckpt, state = f"{tmp}/dp2tp2", {}
    want_losses, want_norms, _, _ = reference()
    out = {"reference": {"losses": want_losses, "norms": want_norms}}
    out["dp2tp2"] = checked(_train_and_save, ckpt, state)
    if "saved" in state:
        out["dp1tp4"] = checked(_resume_at, 1, 4, ckpt, state)
        out["dp4tp1"] = checked(_resume_at, 4, 1, ckpt, state)
        out["unsharded"] = checked(_into_unsharded, ckpt, state)
    out["mixed_precision"] = checked(_mixed_precision)
    return out

