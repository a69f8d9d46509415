"""bench/gpu.sh and bench/gpu_decode.py on a machine without a GPU: what can run on CPU.

The CUDA-graph decode check itself needs a GPU; here: the shell script's usage errors and its
clean skip, the decode script's arguments and skip, and the verdict it prints from a result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_decode

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU paths")


def _gpu_sh(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_gpu_sh_skips_cleanly_without_a_gpu():
    done = _gpu_sh()  # every check
    assert done.returncode == 0, done.stderr
    assert "no CUDA device visible to torch; skipped" in done.stdout


@pytest.mark.parametrize("args", [("warp",), ("all", "--steps", "2")])
def test_gpu_sh_usage_errors(args):
    done = _gpu_sh(*args)
    assert done.returncode == 2
    assert "bench/gpu.sh" in done.stderr


def test_decode_arguments_and_skip(capsys):
    args = gpu_decode.parse(["--layers", "2", "--dtype", "bfloat16"])
    assert (args.device, args.layers, args.dtype, args.new) == ("cuda", 2, "bfloat16", 64)
    with pytest.raises(SystemExit) as e:
        gpu_decode.parse(["--new", "1"])  # no decode call to compile
    assert e.value.code == 2
    assert gpu_decode.main([]) == 0
    assert "no CUDA device; skipped" in capsys.readouterr().out


def _result(device="cuda", compiled_same=True, skips=0) -> dict:
    config = vars(gpu_decode.parse(["--device", device]))
    row = {"ms_per_token": 2.0, "same_as_eager": True, "same_as_unsharded": True}
    return {"device": "H", "world_size": 2, "config": config, "cudagraph_skips": skips,
            "collectives_per_decode_step": {"all_reduce": 16},
            "rows": {"unsharded eager": row, "tpcompile eager": row,
                     "tpcompile reduce-overhead": {**row, "same_as_eager": compiled_same}}}


def test_decode_verdict(capsys):
    assert gpu_decode.report(_result()) == 0
    assert "| tpcompile reduce-overhead | 2.000 | 500 | yes | yes |" in capsys.readouterr().out
    assert gpu_decode.report(_result(compiled_same=False)) == 1  # tokens differ from eager
    assert gpu_decode.report(_result(skips=1)) == 1  # a CUDA graph was not used
    assert gpu_decode.report(_result(device="cpu", skips=1)) == 0  # CPU: no graphs expected
    out = capsys.readouterr().out
    assert out.count("FAILED") == 2
