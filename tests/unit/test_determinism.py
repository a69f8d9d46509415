"""The same model and world size always give the same plan and graphs: across fresh processes,
Python hash seeds (set iteration order), the order sets of graph nodes iterate in (their
``id()``s, which follow allocation and garbage collection) and CPU load, so ranks started
separately agree."""

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
# one environment per probe: the second has another hash seed and drawn node hashes (see the
# probe), so any set order that reaches the plan differs between the two
RUNS = ({"PYTHONHASHSEED": "0"}, {"PYTHONHASHSEED": "4242", "TPCOMPILE_PROBE_NODE_HASH": "7"})
BUSY_S = 10  # a busy loop beside the probes (it ends itself should the test die first)


def test_plans_and_graphs_are_identical_across_processes_hash_seeds_and_load():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + "
                             f"{BUSY_S}\nwhile time.monotonic() < end: pass"])
    try:
        procs = [subprocess.Popen([sys.executable, str(PROBE)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, **run, "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": PYTHONPATH})
                 for run in RUNS]
        texts = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        busy.kill()
        busy.wait()
    assert all(p.returncode == 0 for p in procs)
    outs = [json.loads(t) for t in texts]
    assert len(outs[0]) >= 4 and "hf_gemma3" in outs[0]
    for out in outs[1:]:
        assert out.keys() == outs[0].keys()
        for name in outs[0]:
            a, b = outs[0][name], out[name]
            assert a["plan"] == b["plan"], name
            assert a["codes"] == b["codes"], name
            assert a["digests"] == b["digests"] and len(set(a["digests"])) == 1, name
    assert len(set(texts)) == 1  # byte for byte
