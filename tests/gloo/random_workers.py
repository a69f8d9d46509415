"""Rank bodies for test_random_streams.py: models that draw random numbers, seeded per rank.

The contract (tpcompile.runtime.calls): ranks of a tensor-parallel group are seeded the same;
data-parallel replicas may differ. A call that draws from differently seeded generators raises
``RandomStateError`` on every rank; one that draws nothing runs whatever the seeds.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist
from torch import nn

import tpcompile
from tpcompile.tools.numerics import grad_errors, rel_err

SEED = 1234


class Guided(nn.Module):
    """Classifier-free guidance's label dropout and a noised input (replicated draws), then an
    MLP with dropout on its sharded hidden activation (a draw of the whole mask)."""

    def __init__(self, dim: int = 32, hidden: int = 64, labels: int = 10, p: float = 0.25):
        super().__init__()
        self.embed, self.p = nn.Embedding(labels, dim), p
        self.up, self.down, self.drop = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Dropout(p)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dropped = torch.rand(labels.shape, device=labels.device) < self.p
        c = self.embed(torch.where(dropped, torch.zeros_like(labels), labels))
        h = x + c[:, None] + 0.1 * torch.randn_like(x)
        return self.down(self.drop(torch.relu(self.up(h))))


class Quiet(Guided):
    """The same layers, nothing random."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x + self.embed(labels)[:, None])))


def _inputs():
    g = torch.Generator().manual_seed(7)
    return torch.randn(2, 4, 32, generator=g), torch.randint(1, 10, (2,), generator=g)


def _run(model: nn.Module, mesh, seed: int) -> dict:
    """One training call of the parallelized ``model`` under ``seed``, against the unsharded
    model under the same seed: errors, or the refusal's type and message."""
    inputs = _inputs()
    reference = copy.deepcopy(model)
    tp = tpcompile.parallelize(model, inputs, mesh)
    torch.manual_seed(seed)
    try:
        out = tp(*inputs)
    except tpcompile.TPCompileError as e:
        return {"refused": type(e).__name__, "message": str(e),
                "sharded": tp.plan.styles()["up.weight"] == "colwise"}
    torch.manual_seed(seed)
    ref = reference(*inputs)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    grads = grad_errors(tp.full_grads(), {n: p.grad for n, p in reference.named_parameters()})
    return {"output_err": rel_err(out, ref), "grad_err": max(grads.values()),
            "sharded": tp.plan.styles()["up.weight"] == "colwise"}


def streams(rank: int, world_size: int, dp: int) -> dict:
    """Cases on a ``dp`` x ``world_size // dp`` mesh (1-D when ``dp`` is 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    tp_size = world_size // dp
    mesh = init_device_mesh("cpu", (dp, tp_size), mesh_dim_names=("dp", "tp"))["tp"] \
        if dp > 1 else None
    dp_rank = rank // tp_size
    torch.manual_seed(0)
    drawing, quiet = Guided().train(), Quiet()
    cases = {"same_seed": (drawing, SEED + dp_rank),
             "seeded_per_rank": (drawing, SEED + rank),
             "no_draws_seeded_per_rank": (quiet, SEED + rank)}
    out = {}
    for name, (model, seed) in cases.items():
        try:
            out[name] = _run(model, mesh, seed)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
    dist.barrier()
    return out
