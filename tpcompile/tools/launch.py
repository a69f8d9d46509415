"""Run a function on N local ranks with gloo: the demo's and the test suite's launcher.

Production jobs use ``torchrun``; this exists so that ``tpcompile demo`` and the tests need no
launcher knowledge. Ranks rendezvous through a temporary file (no port races), run with one
intra-op thread each (the CI machine has 2 cores), and every rank's return value or traceback
comes back to the caller. Ranks fork from a server process that imported torch and tpcompile
once (the ``forkserver`` start method; :func:`preload` adds modules), which saves each rank of
each launch two seconds of imports; they get the caller's environment as it is at the launch,
as spawned processes would (the server restarts when a variable read at import changed). A
rank that hangs is killed after ``timeout`` seconds and reported, never waited on forever.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import re
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver

__all__ = ["run_on_ranks", "preload", "RankError"]


class RankError(RuntimeError):
    """One or more ranks failed or timed out; the message holds their tracebacks."""


def _resolve(target: str):
    """'pkg.module:fn' or '/path/to/file.py:fn' -> the function."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_tpcompile_rank_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # as import does: dataclasses look their module up
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _child(rank, world_size, store_path, target, args, results, timeout, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            # pickled here, once: an unpicklable result fails in this try and is reported; in
            # the queue's feeder thread it would be dropped, the rank seen to exit 0 silently
            results.put((rank, True, pickle.dumps(_resolve(target)(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


# what the fork server imports once, so that no rank imports it again: torch, and tpcompile
# itself (``_child`` lives here; tpcompile imports torch._dynamo and inductor, ~2 s a rank)
PRELOAD = ["torch", "torch.distributed", "tpcompile.tools.launch"]
# variables read when those modules are imported (inductor's compile_threads, TORCH_LOGS,
# Hugging Face's offline switches, ...): a rank forked from a server that imported them under
# other values would not see the caller's
_READ_AT_IMPORT = re.compile(r"^(PYTORCH|TORCH|OMP_|MKL_|KMP_|HF_|TRANSFORMERS)")
_server: dict = {}  # the running fork server's preload list and those variables


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (the test suite's: transformers, ~2 s a
    rank a launch otherwise); a server already running restarts at the next launch."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def _context(fresh_interpreter: bool):
    """spawn, or the fork server: restarted when what it imported or the variables read then
    changed since it started."""
    if fresh_interpreter:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    now = {"preload": list(PRELOAD),
           "env": {k: v for k, v in os.environ.items() if _READ_AT_IMPORT.match(k)}}
    if _server and _server != now:
        forkserver._forkserver._stop()  # the next launch starts one that imports under `now`
    _server.update(now)
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_on_ranks(target: str, world_size: int, *args, timeout: float = 600.0,
                 fresh_interpreter: bool = False) -> list:
    """Call ``target(rank, world_size, *args)`` on ``world_size`` gloo ranks; per-rank results.

    ``target`` is 'pkg.module:function' or '/path/file.py:function' (so test files work too).
    ``fresh_interpreter``: start each rank as a new Python process (``spawn``), for settings
    read only when a process starts (glibc's ``MALLOC_*`` variables).
    """
    ctx = _context(fresh_interpreter)
    results = ctx.Queue()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child,
                             args=(r, world_size, store, target, args, results, timeout, env))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + timeout
        try:
            while len(got) < world_size:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                    got[rank] = (ok, value)
                    if not ok:
                        deadline = min(deadline, time.monotonic() + 30)  # let the others report
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                    if dead and results.empty():
                        time.sleep(0.5)
                        if results.empty():
                            for r in dead:
                                got[r] = (False, f"rank {r} exited with code {procs[r].exitcode}")
                    if time.monotonic() > deadline:
                        break
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    failures = [f"--- rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    missing = [r for r in range(world_size) if r not in got]
    if failures or missing:
        lines = failures + ([f"--- ranks {missing} did not finish within {timeout:.0f}s"] if missing else [])
        raise RankError(f"{target} failed on {world_size} ranks:\n" + "\n".join(lines))
    return [pickle.loads(got[r][1]) for r in range(world_size)]
