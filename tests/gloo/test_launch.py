"""The launcher's fork server (tpcompile.tools.launch): ranks see the caller's environment as
it is at each launch, including the variables torch reads only when it is imported."""

from __future__ import annotations

import os
import sys

import pytest

from tpcompile.tools.launch import run_on_ranks

pytestmark = pytest.mark.dist

HERE = os.path.abspath(__file__)


def import_time_settings(rank: int, world_size: int) -> tuple:
    import torch._inductor.config as inductor

    return (inductor.compile_threads, os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"),
            "tpcompile" in sys.modules)


def test_a_variable_read_at_import_reaches_the_ranks(monkeypatch):
    """inductor sets compile_threads when imported: a server that imported it under another
    value restarts, so each launch's ranks read the value of that launch."""
    for threads in ("1", "3"):
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", threads)
        for got in run_on_ranks(f"{HERE}:import_time_settings", 2):
            assert got == (int(threads), threads, True), got
