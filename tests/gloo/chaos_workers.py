"""Rank-side body of the chaos matrix (tests/gloo/test_chaos.py): one rank misbehaves.

For each check mode and each perturbation the ranks build a fresh process group with a short
timeout (a collective that times out leaves its group unusable), parallelize a one-layer Llama
on it, run one agreed training step, then the *victim* (the last rank) deviates while the
others make the same correct call. Every rank records how its step ended: the exception's type
and text and the seconds it took, or "no error". Then the ranks compare outcomes over the world
group (never touched by a perturbation); when every rank stopped on an input error (so no
collective of the model was issued) they make one more, correct call and record its error
against the unsharded model. The victim's exit comes last: its process is gone afterwards.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.tools import models
from tpcompile.tools.numerics import rel_err

CONFIG = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, hidden=64, vocab=64, max_seq=32)
BATCH, SEQ = 2, 8
INPUT_ERRORS = ("InputMismatchError", "InputError")


def _ids(batch=BATCH, seq=SEQ, dtype=torch.int64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab"], (batch, seq), generator=g).to(dtype)


def _step(tp, x, backward=True):
    y = tp(x)
    if backward:
        y.float().sum().backward()
    return y


def _timed(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        return {"error": "no error", "seconds": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start,
                "is_runtime_error": isinstance(e, RuntimeError)}


def _sleep(timeout_s):
    time.sleep(timeout_s + 1.5)  # alive, but in no collective until the others gave up


# perturbation -> (what every other rank does, what the victim does); each takes (tp, timeout_s)
PERTURBATIONS = {
    "batch": (lambda tp, t: _step(tp, _ids()), lambda tp, t: _step(tp, _ids(batch=3))),
    "sequence": (lambda tp, t: _step(tp, _ids()), lambda tp, t: _step(tp, _ids(seq=12))),
    # neither call was made before: new to every rank, so "new" mode checks it too
    "new_sequence": (lambda tp, t: _step(tp, _ids(seq=16)), lambda tp, t: _step(tp, _ids(seq=24))),
    "dtype": (lambda tp, t: _step(tp, _ids()), lambda tp, t: _step(tp, _ids(dtype=torch.int32))),
    # a data loader that gives each rank its own batch: the same shapes, other token ids (a
    # call new to every rank, so "new" mode compares it too)
    "values": (lambda tp, t: _step(tp, _ids(seq=20)), lambda tp, t: _step(tp, _ids(seq=20, seed=3))),
    # the same, on a later call of an agreed description: compared by "every" mode only
    "later_values": (lambda tp, t: _step(tp, _ids()), lambda tp, t: _step(tp, _ids(seed=3))),
    "raise_in_forward": (lambda tp, t: _step(tp, _ids()),  # an id beyond the table: InputError
                         lambda tp, t: _step(tp, _ids().fill_(CONFIG["vocab"]))),
    "skip_forward": (lambda tp, t: _step(tp, _ids()), lambda tp, t: _sleep(t)),
    # the victim's next forward meets the others' backward
    "skip_backward": (lambda tp, t: [_step(tp, _ids()), _step(tp, _ids())],
                      lambda tp, t: [_step(tp, _ids(), backward=False), _step(tp, _ids())]),
}


def _case(rank, world_size, mode, name, timeout_s, model, reference):
    group = dist.new_group(timeout=timedelta(seconds=120))  # planning may take a while
    tp = tpcompile.parallelize(model, (_ids(),), mesh=group, check_calls=mode)
    for _ in range(2):  # agreed steps: the calls of the perturbation below are cached (the
        _step(tp, _ids())  # first call, and every later one: it follows a backward)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    others, victim = PERTURBATIONS[name]
    out = _timed(lambda: (victim if rank == world_size - 1 else others)(tp, timeout_s))
    out["error_type"] = out["error"].split(":")[0] if out["error"] != "no error" else None
    every = [None] * world_size
    dist.all_gather_object(every, out["error_type"])  # the world group is healthy
    if all(e in INPUT_ERRORS for e in every):  # no model collective ran: the group still works
        out["recovered_err"] = rel_err(tp(_ids(seed=2)), reference(_ids(seed=2)))
    return out


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, features):
        return self.down(torch.relu(self.up(features)))


def _float_values(rank: int, world_size: int, mode: str) -> dict:
    """A module of float features; the victim's features differ from the others' on the first
    call ("new" compares it) and on a later call of an agreed description (``"every"``)."""
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    mine = x + 1e-3 if rank == world_size - 1 else x
    tp = tpcompile.parallelize(model, (x,), check_calls=mode)
    with torch.no_grad():  # one description for every call (no "after a backward")
        out = {"first": _timed(lambda: tp(mine))}
        tp(x)  # an agreed call
        out["later"] = _timed(lambda: tp(mine))
        out["after"] = rel_err(tp(x), model(x))  # no model collective ran: the group works
    return out


def chaos(rank: int, world_size: int, modes: list[str], names: list[str], timeout_s: float) -> dict:
    """{mode: {perturbation: outcome}} and {"float_values": {mode: outcomes}}, then the victim
    exits ({"exit": ...} on the others)."""
    torch.manual_seed(0)
    model = models.build("llama", **CONFIG)
    out = {mode: {name: _case(rank, world_size, mode, name, timeout_s, model, model)
                  for name in names} for mode in modes}
    out["float_values"] = {mode: _float_values(rank, world_size, mode) for mode in modes}
    group = dist.new_group(timeout=timedelta(seconds=120))
    tp = tpcompile.parallelize(model, (_ids(),), mesh=group)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    y = tp(_ids())
    if rank == world_size - 1:
        return out  # exits: its process groups are destroyed and the process ends
    time.sleep(1)
    out["exited_backward"] = _timed(lambda: y.sum().backward())
    out["exited_forward"] = _timed(lambda: tp(_ids()))
    return out
