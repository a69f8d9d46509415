"""The report is the run: what ``explain`` says rank 0 issues is what its module executes.

For models of the support table (tests/unit/test_support_table.py), the idiom corpus
(zoo/idioms), the CI transformers families (bench.hf_sweep.REPRESENTATIVE) and an MMDiT
(zoo/joint_attention.py: joint attention, adaLN from a timestep, a last block whose context
output is unused), each planned at 2 ranks (a few at 3, where shards are uneven), with and
without activation checkpointing:

- the collectives rank 0's parallelized module dispatches on a warm call, forward and the
  backward of every output, counted by ``count_executed_collectives`` on a fake process group
  (one process; the fake backend's collectives return garbage but are dispatched), equal the
  report's per phase and kind;
- the parameter table says what the module holds: each parameter's local shape on rank 0 is
  the module's, the report's bytes per rank are rank 0's parameters' bytes, and a weight the report names kept replicated is whole on every rank and not
  listed with a split style.

CI runs a representative subset; ``pytest -m slow`` runs the rest.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import tpcompile
from tpcompile.inspect.executed import count_executed_collectives
from tpcompile.runtime.collectives import COLLECTIVE_FNS
from tpcompile.tools import models
from bench import hf_sweep
from zoo import idioms, joint_attention

WORLD_SIZE = 2
FULL, SELECTIVE = "full", "selective"  # activation_checkpointing modes


def _init_rank0(world_size: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@pytest.fixture
def rank0():
    """Rank 0 of a fake 2-rank process group (``check_report_is_the_run`` may make another
    size), torn down after the test."""
    _init_rank0(WORLD_SIZE)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _nonzero(counts: dict) -> dict:
    return {phase: {k: n for k, n in kinds.items() if n} for phase, kinds in counts.items()}


def check_report_is_the_run(model, inputs: tuple, kwargs: dict | None = None, *,
                            world_size: int = WORLD_SIZE, **options):
    """Plan ``model``, parallelize it as rank 0 of ``world_size`` and compare the report
    with the module; returns both."""
    kwargs = kwargs or {}
    if world_size != dist.get_world_size():
        _init_rank0(world_size)
    report = tpcompile.explain(model, inputs, world_size, example_kwargs=kwargs, **options)
    tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs, **options)
    ran = count_executed_collectives(tp, inputs, kwargs)
    assert _nonzero(ran) == _nonzero(report.collective_counts()), (
        f"explain lists {report.collective_counts()}, the module ran {ran}")
    held = dict(tp.named_parameters())
    for name, entry in report.params.items():
        if name in held:
            assert list(held[name].shape) == entry.local_shape, name
    held_bytes = sum(p.numel() * p.element_size() for p in tp.parameters())  # tied: once
    assert held_bytes == report.param_bytes_per_rank[0], (held_bytes, report.param_bytes_per_rank)
    for item in report.kept_replicated:
        entry = report.params.get(item["node"])
        if entry is None:
            continue
        assert entry.style == "replicate" and entry.dim is None, (item["node"], entry.style)
        assert all(s == entry.global_shape for s in entry.local_shapes), item["node"]
    return report, tp


def _param(value, ci: bool, name: str):
    return pytest.param(value, id=name, marks=() if ci else pytest.mark.slow)


def test_mmdit_unused_context_and_timestep_syncs(rank0):
    """The timestep's gradient sync is in the graph but never runs (the timestep requires no
    grad); the report says so, and lists no out / fc2 weight kept replicated. With the cost
    rule off: by default the timestep embedder, on one row per sample, is kept whole by cost and
    has no sync at all (tests/unit/test_chain_cost.py)."""
    model = joint_attention.build()
    inputs = joint_attention.example_inputs(model)
    report, tp = check_report_is_the_run(model, inputs, chain_cost="off")
    in_graph = sum(len(COLLECTIVE_FNS[n.target][1]) for n in tp.graph_module.graph.nodes
                   if n.op == "call_function" and n.target in COLLECTIVE_FNS)
    listed_backward = sum(report.collective_counts()["backward"].values())
    assert listed_backward < in_graph, (listed_backward, in_graph)  # the timestep's sync
    listed = {item["node"] for item in report.kept_replicated}
    assert not {n for n in listed if n.endswith(("out.weight", "fc2.weight"))}, listed


def test_mmdit_input_that_requires_grad_is_synced(rank0):
    """The same graph with latents that require grad: their sync runs, and is listed."""
    model = joint_attention.build()
    latents, context, timestep = joint_attention.example_inputs(model)
    inputs = (latents.requires_grad_(), context.requires_grad_(), timestep.requires_grad_())
    check_report_is_the_run(model, inputs)


SUPPORT_IN_CI = {("MLP: Linear-GELU-Linear blocks", ()),
                 ("GPT-2 (built-in)", ("sequence_parallel",)),
                 ("HF LlamaForCausalLM with labels", ("loss_parallel", "vocab_parallel"))}


@pytest.mark.parametrize("options", [pytest.param({}, id="default"), pytest.param(
    {"sequence_parallel": True, "activation_checkpointing": FULL}, id="sequence, full")])
def test_uneven_shards_at_3_ranks(rank0, options):
    """64 features and 16 tokens over 3 ranks: uneven shards, whose reduce-scatters run as an
    all-reduce and a slice (and are listed so), recomputed ones included."""
    model = models.build("llama")
    check_report_is_the_run(model, models.example_inputs(model), world_size=3, **options)


class CutBranch(nn.Module):
    """Two residual MLPs; the first one's gradient is cut (``detach``, ``no_grad``) or its
    output written into a fresh tensor in place (``write``), so whether its gradient sync
    runs depends on autograd, not on the graph holding the call."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.embed, self.norm = how, nn.Linear(8, 32), nn.LayerNorm(32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.fc3, self.fc4 = nn.Linear(32, 64), nn.Linear(64, 32)

    def branch(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x):
        x = self.embed(x)
        if self.how == "detach":
            h = self.branch(x).detach()
        elif self.how == "no_grad":
            with torch.no_grad():
                h = self.branch(x)
        else:
            h = torch.zeros_like(x)
            h[:, :4] = self.branch(x)[:, :4]
        x = x + h
        return x + self.fc4(F.gelu(self.fc3(self.norm(x))))


@pytest.mark.parametrize("how", ["detach", "no_grad", "write"])
def test_gradient_cut_or_written_in_place(rank0, how):
    torch.manual_seed(0)
    check_report_is_the_run(CutBranch(how), (torch.randn(2, 8, 8),))


def _support_rows():
    from unit.test_support_table import ROWS
    return [_param(i, (family, tuple(sorted(options))) in SUPPORT_IN_CI,
                   f"{family} {_options_id(options)}")
            for i, (family, _, options, _) in enumerate(ROWS)]


def _options_id(options: dict) -> str:
    return "+".join(sorted(options)) or "default"


@pytest.mark.parametrize("row", _support_rows())
def test_support_table_rows(rank0, row):
    from unit.test_support_table import ROWS
    _, build, options, _ = ROWS[row]
    model, inputs, kwargs = build()
    check_report_is_the_run(model, inputs, kwargs, **options)


def _checkpointed_hf_llama():
    pytest.importorskip("transformers")
    from zoo.hf_models import hf_inputs, hf_model
    model = hf_model("llama").train()
    model.gradient_checkpointing_enable()
    ids, kwargs = hf_inputs(model)
    return model, (ids,), kwargs, {}


def _builtin(name, **options):
    def build():
        model = models.build(name)
        return model, models.example_inputs(model), {}, options
    return build


def _mmdit_full():
    model = joint_attention.build()
    return model, joint_attention.example_inputs(model), {}, {"activation_checkpointing": "full"}


CHECKPOINTED = {  # name: (build, in CI)
    "llama full": (_builtin("llama", activation_checkpointing=FULL), True),
    "gpt2 full, sequence parallel": (
        _builtin("gpt2", activation_checkpointing=FULL, sequence_parallel=True), False),
    "llama selective, sequence parallel": (
        _builtin("llama", activation_checkpointing=SELECTIVE, sequence_parallel=True), False),
    "mmdit full": (_mmdit_full, False),
    "HF llama gradient_checkpointing_enable()": (_checkpointed_hf_llama, False),
}


@pytest.mark.parametrize("case", [_param(k, ci, k) for k, (_, ci) in CHECKPOINTED.items()])
def test_checkpointed_regions(rank0, case):
    """Full recomputation issues some forward collectives again in backward; the report
    lists exactly those (tpcompile.inspect.explain.recompute), selective recomputation none."""
    model, inputs, kwargs, options = CHECKPOINTED[case][0]()
    report, _ = check_report_is_the_run(model, inputs, kwargs, **options)
    again = [c for c in report.collectives if c.recomputed]
    assert bool(again) == (options.get("activation_checkpointing") != SELECTIVE), case


IDIOMS_IN_CI = ("fused_qkv_timm", "parallel_block_residual_first")


@pytest.mark.parametrize("name", [_param(n, n in IDIOMS_IN_CI, n) for n in idioms.IDIOMS])
def test_idioms(rank0, name):
    check_report_is_the_run(idioms.build(name), idioms.example_inputs(name=name))


def _families():
    return [_param(f, f in ("Qwen3ForCausalLM",), f) for f in hf_sweep.REPRESENTATIVE]


@pytest.mark.parametrize("family", _families())
def test_hf_families(rank0, family):
    model = hf_sweep.build(family, "train")
    check_report_is_the_run(model, (hf_sweep.example_ids(),))
