"""Rank-side bodies of ``test_state.py``: checkpoints, loading, memory, clipping, training.

Kept apart from ``workers.py`` (the numerics bodies) so each file owns one subject. Every body
runs many checks in one spawn and returns plain data; an exception in one check is returned as
its traceback string instead of stopping the others.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.state import checkpoint
from tpcompile.tools import models
from tpcompile.tools.numerics import compare, rel_err


class FusedGQA(nn.Module):
    """One fused qkv weight with 8 query and 2 KV heads: at 4 ranks each rank holds its query
    heads plus every KV head, so its shard is several ranges, some of them held by every rank."""

    def __init__(self, dim=64, heads=8, kv=2):
        super().__init__()
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)
        self.h, self.kv, self.hd = heads, kv, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv) * self.hd)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=2)
        q = q.view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = (t.view(B, T, self.kv, self.hd).transpose(1, 2)[:, :, None]
                .expand(B, self.kv, self.h // self.kv, T, self.hd).reshape(B, self.h, T, self.hd)
                for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


def build(name: str, seed: int, **cfg) -> nn.Module:
    if name == "fused_gqa":
        torch.manual_seed(seed)
        return FusedGQA()
    return models.build(name, seed=seed, **cfg)


def inputs_for(model: nn.Module, seed: int = 0) -> tuple:
    if isinstance(model, FusedGQA):
        return (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(seed)),)
    return models.example_inputs(model, seed=seed)


def checked(fn, *args) -> dict:
    """Run one check; its failure is data for the test, not the end of the spawn."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def unequal(got: dict, want: dict) -> list[str]:
    """Keys whose tensors differ (bitwise), plus keys present on one side only."""
    keys = set(got) | set(want)
    return sorted(k for k in keys if k not in got or k not in want or not torch.equal(got[k], want[k]))


# ---------------------------------------------------------------------------- peak memory
def _peak_rss() -> int:
    """This process's peak resident set in bytes (``VmHWM``).

    Not ``getrusage().ru_maxrss``: in a spawned process that also counts the peak of the
    process it was forked from before ``exec`` (here the test runner, which wrote the big file).
    """
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _peak_rss_delta(fn) -> int:
    """Peak RSS growth while ``fn`` runs (Linux: the peak mark is reset to the current RSS).

    Free heap memory is returned to the system first, so that what ``fn`` allocates shows up as
    new resident pages instead of silently reusing pages freed earlier.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _peak_rss()
    fn()
    return _peak_rss() - base


def _peak_memory(big_file: str, cfg: dict) -> dict:
    """Build a large MLP on meta, parallelize, fill its shards: peak RSS growth per route."""
    warm = models.build("mlp")  # import export's machinery before measuring
    tpcompile.parallelize(warm, models.example_inputs(warm))
    x = (torch.zeros(2, 8, cfg["dim"], device="meta"),)
    out = {}

    def from_file():
        with torch.device("meta"):
            model = models.build("mlp", **cfg)
        out["tp_file"] = tpcompile.parallelize(model, x)
        tpcompile.load_full_state_dict(out["tp_file"], big_file)

    def from_initialisers():
        with torch.device("meta"):
            model = models.build("mlp", **cfg)
        out["tp_init"] = tpcompile.parallelize(model, x)
        tpcompile.init_shards(out["tp_init"], model)

    file_delta = _peak_rss_delta(from_file)
    del out["tp_file"]
    init_delta = _peak_rss_delta(from_initialisers)
    tp = out.pop("tp_init")
    # control: the same measurement sees the whole model when it is built eagerly
    eager_delta = _peak_rss_delta(lambda: out.update(eager=models.build("mlp", **cfg)))
    plan = tp.plan.params
    return {
        "file_delta": file_delta, "init_delta": init_delta, "eager_delta": eager_delta,
        "local_bytes": sum(t.numel() * t.element_size() for t in tp.state_dict().values()),
        "full_bytes": sum(4 * torch.Size(p.global_shape).numel() for p in plan.values()),
        "largest_full_tensor": max(4 * torch.Size(p.global_shape).numel() for p in plan.values()),
    }


# ---------------------------------------------------------------------------- checkpoints
RESHARD_MODELS = ("gpt2", "llama", "fused_gqa")


def _save_ws2(tmp: str, group2, tps: dict) -> dict:
    """Ranks 0-1 as a 2-rank TP group: save a checkpoint of each model (seed 1)."""
    out = {}
    for name in RESHARD_MODELS:
        model = build(name, seed=1)
        tp = tpcompile.parallelize(model, inputs_for(model), mesh=group2)
        checkpoint.save(tp, os.path.join(tmp, f"{name}_ws2"))
        out[name] = {"gathered_vs_model": unequal(tp.full_state_dict(), model.state_dict())}
        tps[name] = tp
    return out


def _reshard_2_to_4(tmp: str, refs: dict) -> dict:
    """All 4 ranks: load the 2-rank checkpoints, check, then step and save a 4-rank one."""
    out = {}
    for name in RESHARD_MODELS:
        model = build(name, seed=2)
        tp = tpcompile.parallelize(model, inputs_for(model))
        checkpoint.load(tp, os.path.join(tmp, f"{name}_ws2"))
        want = build(name, seed=1).state_dict()
        r = {"loaded_2_to_4": unequal(tp.full_state_dict(), want)}
        on_rank0 = tp.full_state_dict(rank=0)
        r["gather_to_rank0"] = unequal(on_rank0, want) if dist.get_rank() == 0 else sorted(on_rank0)
        plain = build(name, seed=3)
        dcp.load(plain.state_dict(), checkpoint_id=os.path.join(tmp, f"{name}_ws2"))
        r["unsharded_dcp_load"] = unequal(plain.state_dict(), want)
        # new values (one SGD step), saved at 4 ranks for the trip back
        tp(*inputs_for(model, seed=1)).float().pow(2).mean().backward()
        torch.optim.SGD(tp.parameters(), lr=0.5).step()
        refs[name] = tp.full_state_dict()
        r["changed_by_step"] = len(unequal(refs[name], want)) > 0
        checkpoint.save(tp, os.path.join(tmp, f"{name}_ws4"))
        out[name] = r
    return out


def _reshard_4_to_2(tmp: str, tps: dict, refs: dict) -> dict:
    out = {}
    for name, tp in tps.items():
        with torch.no_grad():
            for p in tp.state_dict().values():
                p.fill_(7.0)
        checkpoint.load(tp, os.path.join(tmp, f"{name}_ws4"))
        out[name] = {"loaded_4_to_2": unequal(tp.full_state_dict(), refs[name])}
    return out


def _plain_checkpoint_into_tp(tmp: str) -> dict:
    """A checkpoint the unsharded model wrote with plain dcp.save loads into 4 ranks' shards,
    and a 4-rank checkpoint converts to one torch.save file of the full model."""
    model = build("llama", seed=4)
    path = os.path.join(tmp, "llama_plain")
    dcp.save(model.state_dict(), checkpoint_id=path)
    tp = tpcompile.parallelize(build("llama", seed=5), inputs_for(model))
    checkpoint.load(tp, path)
    out = {"plain_into_tp": unequal(tp.full_state_dict(), model.state_dict())}
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        target = os.path.join(tmp, "llama_ws4.pt")
        dcp_to_torch_save(os.path.join(tmp, "llama_ws4"), target)
        out["torch_save_keys"] = sorted(torch.load(target, weights_only=True))
    return out


def _clip_checks() -> dict:
    """Global grad norm and clipped grads of the shards vs torch's on the unsharded model."""
    out = {}
    for name in ("fused_gqa", "llama", "gpt2"):
        model = build(name, seed=6)
        x = inputs_for(model, seed=2)
        tp = tpcompile.parallelize(model, x)
        ref = copy.deepcopy(model)
        ref(*x).float().pow(2).mean().backward()
        tp(*x).float().pow(2).mean().backward()
        r = {"inf": rel_err(tpcompile.grad_norm(tp, float("inf")),
                            nn.utils.get_total_norm([p.grad for p in ref.parameters()], float("inf")))}
        max_norm = 0.1
        want = nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        got = tpcompile.clip_grad_norm_(tp, max_norm)
        r["norm"], r["clipping"] = rel_err(got, want), bool(want > max_norm)
        grads = tp.full_grads()
        r["grads"] = max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters())
        out[name] = r
    return out


# ---------------------------------------------------------------------------- training
MAX_NORM = 1.0
STEPS = 20
RESUME_LR = 1e-3  # Adam turns rounding noise into lr-sized steps: keep them below the bound


def _batches(vocab: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    data = [torch.randint(0, vocab, (4, 16), generator=g) for _ in range(2)]
    return [data[i % 2] for i in range(steps)]  # a tiny data set: the loss has to fall


def _optimizer(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _ref_clip(model: nn.Module) -> torch.Tensor:
    return nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def _tp_clip(tp) -> torch.Tensor:
    return tpcompile.clip_grad_norm_(tp, MAX_NORM)


def _train(model: nn.Module, clip, batches, bf16: bool = False, opt=None) -> dict:
    opt = opt or _optimizer(model)
    losses, norms = [], []
    for tokens in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                               tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norms.append(float(clip(model)))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def _resume_save(tmp: str, group2) -> dict:
    """Ranks 0-1: 3 training steps at 2 ranks, then a checkpoint with the optimizer's state."""
    model = build("llama", seed=8)
    batches = _batches(model.cfg.vocab, 5)
    tp = tpcompile.parallelize(model, (batches[0],), mesh=group2)
    opt = _optimizer(tp, RESUME_LR)
    done = _train(tp, _tp_clip, batches[:3], opt=opt)
    checkpoint.save(tp, os.path.join(tmp, "resume"), optimizer=opt)
    return done


def _resume_2_to_4(tmp: str) -> dict:
    """4 ranks resume that run (model and AdamW state) for 2 more steps; the unsharded model
    trains 5 steps straight through. Control: the same resume with a fresh optimizer."""
    model = build("llama", seed=8)
    batches = _batches(model.cfg.vocab, 5)
    ref = copy.deepcopy(model)
    want = _train(ref, _ref_clip, batches, opt=_optimizer(ref, RESUME_LR))
    tp = tpcompile.parallelize(build("llama", seed=9), (batches[0],))
    out = {"want": want["losses"][3:]}
    for with_state in (True, False):
        opt = _optimizer(tp, RESUME_LR)
        checkpoint.load(tp, os.path.join(tmp, "resume"), optimizer=opt if with_state else None)
        got = _train(tp, _tp_clip, batches[3:], opt=opt)
        full = tp.full_state_dict()
        key = "" if with_state else "_fresh_optimizer"
        out["losses" + key] = got["losses"]
        out["param_err" + key] = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    return out


def memory_and_checkpoints(rank: int, world_size: int, tmp: str, big_file: str, big_cfg: dict) -> dict:
    """At 4 ranks (and ranks 0-1 as a 2-rank group): peak memory, DCP 2 <-> 4, clipping."""
    assert world_size == 4
    out = {"memory": checked(_peak_memory, big_file, big_cfg)}
    group2 = dist.new_group([0, 1])
    tps, refs = {}, {}
    out["save_ws2"] = checked(_save_ws2, tmp, group2, tps) if rank < 2 else {}
    dist.barrier()
    out["reshard_2_to_4"] = checked(_reshard_2_to_4, tmp, refs)
    out["reshard_4_to_2"] = checked(_reshard_4_to_2, tmp, tps, refs) if rank < 2 else {}
    dist.barrier()
    out["plain"] = checked(_plain_checkpoint_into_tp, tmp)
    out["resume_save"] = checked(_resume_save, tmp, group2) if rank < 2 else {}
    dist.barrier()
    out["resume"] = checked(_resume_2_to_4, tmp)
    out["clip"] = checked(_clip_checks)
    dist.barrier()
    return out


# ---------------------------------------------------------------------------- 2 ranks
def _round_trip_local(model_name: str) -> dict:
    """tp.state_dict() / load_state_dict(): this rank's shards, under the model's own keys."""
    model = build(model_name, seed=1)
    tp = tpcompile.parallelize(model, inputs_for(model))
    saved = {k: v.clone() for k, v in tp.state_dict().items()}
    other = tpcompile.parallelize(build(model_name, seed=2), inputs_for(model))
    before = unequal(other.state_dict(), saved)
    other.load_state_dict(saved)
    return {"keys_are_models": sorted(saved) == sorted(model.state_dict()),
            "differed_before": len(before) > 0, "after_load": unequal(other.state_dict(), saved)}


def _meta_build(tmp: str) -> dict:
    """Meta model -> parallelize -> shards from a safetensors file or from the initialisers;
    outputs and gradients then match the eager model (explicit attention: a baked device)."""
    from safetensors.torch import save_file

    cfg = {"sdpa": False}
    eager = build("llama", seed=3, **cfg)
    x = inputs_for(eager)
    path = os.path.join(tmp, f"llama_{dist.get_rank()}.safetensors")
    save_file(eager.state_dict(), path)
    buffers = tpcompile.buffers_of(lambda: models.build("llama", **cfg))
    out = {}
    with torch.device("meta"):
        meta = models.build("llama", **cfg)
    tp = tpcompile.parallelize(meta, tuple(t.to("meta") for t in x))
    out["meta_devices_before"] = sorted({str(t.device) for t in tp.state_dict().values()})
    try:
        tpcompile.load_full_state_dict(tp, path)
    except tpcompile.TPCompileError as e:
        out["missing_buffers_error"] = str(e)
    tpcompile.load_full_state_dict(tp, path, buffers=buffers)
    out["file"] = compare(eager, tp, x).__dict__
    with torch.device("meta"):
        meta = models.build("llama", **cfg)
    tp = tpcompile.parallelize(meta, tuple(t.to("meta") for t in x))
    torch.manual_seed(3)
    tpcompile.init_shards(tp, meta, buffers=buffers)
    out["init"] = compare(eager, tp, x).__dict__
    out["init_equals_eager_seed"] = unequal(tp.full_state_dict(), eager.state_dict())
    return out


def _training() -> dict:
    """20 AdamW steps with global-norm clipping: sharded vs unsharded, fp32 and bf16 autocast."""
    model = build("llama", seed=7)
    batches = _batches(model.cfg.vocab, STEPS)
    out = {"ref": _train(copy.deepcopy(model), _ref_clip, batches),
           "ref_bf16": _train(copy.deepcopy(model), _ref_clip, batches, bf16=True)}
    for bf16 in (False, True):
        tp = tpcompile.parallelize(model, (batches[0],))
        out["tp_bf16" if bf16 else "tp"] = _train(tp, _tp_clip, batches, bf16=bf16)
    return out


def state_and_training(rank: int, world_size: int, tmp: str) -> dict:
    return {
        "round_trip": {name: checked(_round_trip_local, name) for name in ("gpt2", "llama")},
        "meta": checked(_meta_build, tmp),
        "training": checked(_training),
    }
