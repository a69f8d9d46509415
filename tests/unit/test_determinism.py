"""The same model and world size always give the same plan and graphs: across fresh processes
and Python hash seeds (set iteration order), so ranks started separately agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "determinism_probe.py"
# what pyproject's pythonpath gives the tests: the model zoo (zoo/) and tests/support.py
PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "tests")])


def test_plans_and_graphs_are_identical_across_processes_and_hash_seeds():
    procs = [subprocess.Popen([sys.executable, str(PROBE)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": PYTHONPATH})
             for seed in ("0", "4242")]
    outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0].keys() == outs[1].keys() and len(outs[0]) >= 3
    for name in outs[0]:
        a, b = outs[0][name], outs[1][name]
        assert a["plan"] == b["plan"], name
        assert a["codes"] == b["codes"], name
        assert a["digests"] == b["digests"] and len(set(a["digests"])) == 1, name
