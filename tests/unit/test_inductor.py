"""torch.compile support without a process group: options, dynamic dims, code reading, registration."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tpcompile.tools import models
from tpcompile.api import rewrite
from tpcompile.compile.inductor import (OVERLAP_DEFAULT, collectives_in_code, compile_options, dynamic_dims,
                                        subgraph_calls)


def test_compile_options_turn_the_reorder_passes_on_and_off():
    assert compile_options(overlap=False) == {}
    on = compile_options(overlap=True)
    assert on["reorder_for_compute_comm_overlap"] is True
    assert "sink_waits_iterative" in on["reorder_for_compute_comm_overlap_passes"]
    assert compile_options() == compile_options(OVERLAP_DEFAULT)


def test_collectives_in_code_counts_calls_not_waits_or_comments():
    code = textwrap.dedent("""\
        # Source Nodes: [all_reduce], Original ATen: [_c10d_functional.all_reduce]
        torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '0')
        torch.ops._c10d_functional.wait_tensor.default(buf3)
        buf5 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf4, 2, '0')
        torch.ops._c10d_functional.all_reduce.default(buf6, 'sum', '0')
        torch.ops._c10d_functional.reduce_scatter_tensor.default(buf7, 'sum', 2, '0')
    """)
    assert collectives_in_code(code) == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def test_collectives_in_a_compiled_block_body_count_once_per_call():
    """A repeated block compiled once is one function body called per block (inductor's layout)."""
    code = textwrap.dedent("""\
        def partitioned_fw_subgraph_0_0(args):
            a, = args
            torch.ops._c10d_functional.all_reduce_.default(buf1, 'sum', '0')

            torch.ops._c10d_functional.wait_tensor.default(buf1)
            torch.ops._c10d_functional.all_reduce_.default(buf2, 'sum', '0')
            return (buf2, )
        def call(args):
            buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf4, 2, '0')
            buf1 = partitioned_fw_subgraph_0_0(partitioned_fw_subgraph_0_0_args)
            buf2 = partitioned_fw_subgraph_0_0(partitioned_fw_subgraph_0_0_args)
            buf3 = partitioned_fw_subgraph_0_0(partitioned_fw_subgraph_0_0_args)
    """)
    assert subgraph_calls(code) == {"partitioned_fw_subgraph_0_0": 3}
    assert collectives_in_code(code) == {"all_reduce": 6, "all_gather": 1}


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_dynamic_dims_are_batch_and_sequence(name):
    model = models.build(name, n_layers=1)
    gm, _, _ = rewrite(model, models.example_inputs(model), 2, 0)
    assert dynamic_dims(SimpleNamespace(graph_module=gm)) == ((0, 1),)


@pytest.mark.compile
def test_backend_name_resolves_without_import_and_compiles_unchanged_without_process_group():
    """The entry point makes backend="tpcompile" work with no import; with no process group the
    module is compiled as it is and the report says why."""
    script = textwrap.dedent("""\
        import sys, torch
        assert "tpcompile" in torch._dynamo.list_backends()
        assert "tpcompile" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        x = torch.randn(4, 8)
        expected = model(x)
        out = torch.compile(model, backend="tpcompile")(x)
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6), (out - expected).abs().max()
        from tpcompile.compile.backend import tpcompile_backend
        print(tpcompile_backend.explain())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Sequential: replicated: not parallelized: no process group" in done.stdout
