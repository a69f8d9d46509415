"""bench/gpu.sh and its checks on a machine without a GPU: what can run on CPU.

The checks themselves need a GPU; here: the shell script's usage errors and its clean skip,
each script's arguments and skip, and the verdicts the decode scripts print from a result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_decode, gpu_hf_decode, gpu_memory

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


@pytest.mark.parametrize("script", [gpu_hf_decode, gpu_memory])
def test_hf_checks_skip_without_a_gpu(script, capsys):
    assert script.parse([]).device == "cuda"
    assert script.main([]) == 0
    assert "no CUDA device; skipped" in capsys.readouterr().out


def _hf_result(compiled_same=True) -> dict:
    row = {"ms_per_token": 4.0, "first_2_tokens_ms": 30.0, "same_as_hf_eager": True,
           "same_as_tpcompile_eager": True, "dynamo_graphs": 1}
    rows = {name: dict(row) for name in ("hf eager", "hf static compiled", "tpcompile eager")}
    rows["tpcompile reduce-overhead"] = {**row, "same_as_tpcompile_eager": compiled_same}
    return {"device": "H", "torch": "2.11", "transformers": "5.17",
            "config": vars(gpu_hf_decode.parse([])), "rows": rows}


def test_hf_decode_verdict(capsys):
    assert gpu_hf_decode.report(_hf_result()) == 0
    assert "| tpcompile reduce-overhead | 4.000 | 30.0 | 1 | yes |" in capsys.readouterr().out
    assert gpu_hf_decode.report(_hf_result(compiled_same=False)) == 1
    assert "FAILED" in capsys.readouterr().out
