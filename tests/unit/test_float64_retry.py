"""The sweeps' float64 retry (bench/hf_numerics.py): a float32 miss is judged again in float64,
the model's own float32 casts kept float64, and a retry that cannot run says so in the row."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from bench.hf_numerics import float64_retry
from bench.hf_report import numerics_cell

ROOT = Path(__file__).resolve().parents[2]


def test_a_float32_cast_in_the_model_keeps_float64_in_the_retry():
    """diffusers' Kandinsky 5 casts its timestep with ``time.to(torch.float32)`` before a
    linear layer: its float64 run failed (Float and Double), and the row kept a float32 miss
    that float64 shows exact. In a process of its own: the patch stays for the process."""
    code = textwrap.dedent("""
        import torch
        from bench.hf_numerics import keep_float64_through_float32_casts
        keep_float64_through_float32_casts()
        keep_float64_through_float32_casts()  # a second call changes nothing
        lin = torch.nn.Linear(4, 4).double()
        t = torch.ones(2, 4, dtype=torch.float64)
        assert lin(t.to(torch.float32)).dtype == torch.float64
        assert lin(t.to("cpu", torch.float32)).dtype == torch.float64
        assert lin(t.to(dtype=torch.float32)).dtype == torch.float64
        assert t.float().dtype == torch.float64
        assert torch.ones(2).to(torch.float64).to(torch.float16).dtype == torch.float16
        assert torch.ones(2, dtype=torch.float16).to(torch.float32).dtype == torch.float32
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_retry_that_fails_is_named_in_the_row():
    miss = {"output_err": 1e-7, "max_grad_err": 1e-4, "worst_grad": "blocks.0.q.bias",
            "exact": False}
    row = float64_retry(lambda double: {"error": "RuntimeError: Float and Double"} if double
                        else miss, lambda: 0.0)
    assert row["float64_error"] == "RuntimeError: Float and Double" and not row["exact"]
    cell = numerics_cell({"numerics": row})
    assert "MISMATCH" in cell and "no float64 run: RuntimeError: Float and Double" in cell
    exact = float64_retry(lambda double: {**miss, "output_err": 1e-16, "max_grad_err": 1e-14}
                          if double else miss,
                          lambda: 3e-3)
    assert exact["exact"] and "exact in float64" in numerics_cell({"numerics": exact})
