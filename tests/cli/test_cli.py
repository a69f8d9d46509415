"""The tpcompile command line: explain and diff through subprocess, errors, --help."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tpcompile.tools import models
from tpcompile.tools.cli import main
from tpcompile.inspect.explain.explain import Report

FACTORIES = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 64)
            self.down = nn.Linear(64, 16)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    def build():
        torch.manual_seed(0)
        return Net(), (torch.randn(2, 8, 16),)

    def model_only():
        return Net()

    def broken():
        raise RuntimeError("config file missing")
""")


@pytest.fixture
def factories(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(FACTORIES)
    return path


def run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tpcompile.tools.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_explain_builtin_as_json(tmp_path):
    done = run("explain", "mlp", "--world-size", "2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = Report.from_json(done.stdout)
    assert report.world_size == 2 and report.model == "MLPStack"
    assert report.params["blocks.0.fc1.weight"].style == "colwise"
    assert "capturing MLPStack" in done.stderr and "planning for 2 ranks" in done.stderr  # progress


def test_plan_options_are_flags(tmp_path):
    done = run("explain", "gpt2", "--world-size", "2", "--sequence-parallel", "--json", "--quiet",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ops = {c.op for c in Report.from_json(done.stdout).collectives}
    assert {"reduce_scatter", "all_gather"} <= ops


def test_demo_shards_a_tied_table_with_a_sharded_loss(tmp_path):
    """GPT-2's tied wte = lm_head is cut by vocabulary only when its logits stay sharded: the
    demo takes --loss-parallel, and checks the run against the unsharded model."""
    done = run("demo", "--model", "gpt2", "--vocab-parallel", "--loss-parallel", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    cfg = models.build("gpt2").cfg
    table = next(line for line in done.stdout.splitlines() if "wte.weight" in line).split()
    assert table[:4] == ["wte.weight", "=", "lm_head.weight", "vocab"], table
    # half the vocabulary rows per rank
    assert table[4:] == [f"{cfg.vocab}x{cfg.dim}", "->", f"{cfg.vocab // 2}x{cfg.dim}"], table
    assert "did not apply" not in done.stdout + done.stderr
    assert done.stdout.splitlines()[-2].endswith("-> OK")


def test_experts_is_a_choice(tmp_path, capsys):
    path = tmp_path / "moe.py"
    path.write_text("from zoo.idioms import LM, StackedMoE, example_inputs\n"
                    "def build():\n    return LM(mlp=StackedMoE), example_inputs()\n")
    assert main(["explain", f"{path}:build", "--world-size", "2", "--experts", "expert",
                 "--quiet", "--json"]) == 0
    report = Report.from_json(capsys.readouterr().out)
    assert report.experts["layers.0.mlp"].startswith("expert parallel")


def test_diff_of_a_factory_file_writes_html(factories, tmp_path):
    out = tmp_path / "diff.html"
    done = run("diff", f"{factories}:build", "--world-size", "2", "--passes", "--html", str(out),
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # the forward all-reduce of down's partial sum; up's input x carries no gradient, so the
    # backward all-reduce at the chain's entry never runs and is not counted
    assert done.stdout.strip() == f"wrote {out}: 1 collectives, 0 rewritten shape constants"
    page = out.read_text()
    assert "<h2>pass insert_collectives</h2>" in page and "all_reduce" in page


def test_usage_error_is_one_line_and_a_hint(factories, tmp_path):
    done = run("explain", f"{factories}:model_only", "--world-size", "2", cwd=tmp_path)
    assert done.returncode == 2
    first, hint = done.stderr.splitlines()
    assert first == f"tpcompile explain: error: no example inputs for {factories}:model_only"
    assert hint.startswith("  hint: pass --input-shape 2,128")


def test_input_shape_builds_inputs_for_a_factory(factories, capsys):
    assert main(["explain", f"{factories}:model_only", "--world-size", "2", "--input-shape", "2,8,16",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "up.weight" in out and "colwise" in out and "example inputs float32[2x8x16]" in out


@pytest.mark.parametrize("argv,code,message", [
    (["explain", "nosuch", "--world-size", "2"], 2, "'nosuch' is neither a built-in model"),
    (["explain", "llama", "--world-size", "0"], 2, "--world-size must be >= 1"),
    (["diff", "llama", "--world-size", "2", "--rank", "2"], 2, "--rank 2 is not a rank of 2"),
    (["explain", "llama", "--world-size", "2", "--input-shape", "2,x"], 2, "is not a list of positive"),
    (["explain", "llama", "--world-size", "2", "--config", "heads=4"], 2, "not KEY=VALUE with a known key"),
    (["explain", "no/such/file.py:build", "--world-size", "2"], 2, "no such file"),
    (["explain", "FACTORIES:broken", "--world-size", "2"], 1, "raised RuntimeError: config file missing"),
    (["explain", "llama"], 2, "the following arguments are required: --world-size"),
])
def test_errors_exit_with_one_line_and_a_hint(argv, code, message, factories, capsys):
    argv = [a.replace("FACTORIES", str(factories)) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err.splitlines()
    assert rc == code
    assert len(err) == 2 and message in err[0] and err[1].startswith("  hint: "), err


@pytest.mark.parametrize("command", [[], ["demo"], ["explain"], ["diff"]])
def test_help_everywhere(command, capsys):
    with pytest.raises(SystemExit) as e:
        main(command + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tpcompile {' '.join(command)}".rstrip())
    if command[:1] in (["explain"], ["diff"]):
        assert "MODULE:FACTORY" in out and "--world-size" in out and "--meta" in out
