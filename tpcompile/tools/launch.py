"""Run a function on N local ranks with gloo: the demo's and the test suite's launcher.

Production jobs use ``torchrun``; this exists so that ``tpcompile demo`` and the tests need no
launcher knowledge. Ranks rendezvous through a temporary file (no port races), run with one
intra-op thread each (the CI machine has 2 cores), and every rank's return value or traceback
comes back to the caller. Ranks fork from a server process that imported torch once (the
``forkserver`` start method), which saves each launch seconds of imports per rank; they get
the caller's environment as it is at the launch, as spawned processes would. A rank that
hangs is killed after ``timeout`` seconds and reported, never waited on forever.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["run_on_ranks", "RankError"]


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


def _context(fresh_interpreter: bool):
    if fresh_interpreter:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
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
