"""The catalogue of bad (or merely unusual) inputs: one small model per entry.

Each model is what a user might plausibly write; docs/guarantees.md says what tpcompile does
with each, and tests/unit/test_catalogue.py (planning, exact error texts) and
tests/gloo/test_reliability.py (numerics on real ranks) check it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, H = 8, 12  # model width, hidden width (divisible by 2 and 4)


class MLP(nn.Module):
    def __init__(self, hidden: int = H):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


# ----------------------------------------------------------------- in-place ops

class InPlaceOps(MLP):
    """ReLU(inplace=True), an in-place scale through a view taken before the write, and an
    in-place residual on the row-parallel output: all run on local shards, exactly."""

    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(H, D, bias=False)  # the residual writes into its partial sums

    def forward(self, x):
        h = self.fc1(x)
        view = h.unsqueeze(0)
        h.relu_()
        h = h + view.squeeze(0)  # reads the relu'd values through the earlier view
        y = self.fc2(h.mul_(0.5))
        return y.add_(x)


class SliceAssign(MLP):
    """``h[..., :2] = 0`` into the column-parallel activation, with a view of h taken before the
    write and read after it (so the write cannot be made out of place): it would land on a
    gathered copy while fc2 reads h, so the planner keeps fc1 / fc2 replicated (correct,
    visible)."""

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        tail = h[..., 2:]
        h[..., :2] = 0
        return self.fc2(h) + tail.mean(-1, keepdim=True)


# ----------------------------------------------------------------- state and buffers

class ScaledHidden(MLP):
    """A constant per-feature buffer inside the sharded chain: sliced like the activation."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 2.0, H))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)) * self.scale)


class RunningMean(MLP):
    """A buffer updated in forward from sharded activations (an EMA over hidden features)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(H))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean((0, 1)))
        self.calls.add_(1)
        return self.fc2(h)


class BatchNormHidden(MLP):
    """BatchNorm1d over the hidden features (running statistics updated in training mode)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(H)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(F.relu(self.bn(h.flatten(0, 1)).unflatten(0, h.shape[:2])))


class PythonCounter(MLP):
    """Python state assigned in forward: frozen at capture, so refused."""

    def __init__(self):
        super().__init__()
        self.step = 0

    def forward(self, x):
        self.step += 1
        return self.fc2(F.gelu(self.fc1(x))) * min(1.0, self.step / 10)


class CachesActivation(MLP):
    def forward(self, x):
        self.last_hidden = self.fc1(x)
        return self.fc2(F.gelu(self.last_hidden))


class LazyTable(MLP):
    """A table built on the first call (``if self.table is None``): refused, fixed by a call
    before capture."""

    def __init__(self):
        super().__init__()
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.linspace(0.5, 1.5, H)
        return self.fc2(F.gelu(self.fc1(x)) * self.table)


class _Table:
    """A plain object (no nn.Module) that builds its table on the first call, as Z-Image's
    ``RopeEmbedder`` does its frequencies."""

    def __init__(self):
        self.table = None

    def __call__(self):
        if self.table is None:
            self.table = torch.linspace(0.5, 1.5, H)
        return self.table


class LazyHelperTable(MLP):
    """A module holding such a helper: the cache is built on the helper, not the module."""

    def __init__(self):
        super().__init__()
        self.tables = _Table()

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)) * self.tables())


class RebindsItself(MLP):
    """A plain tensor attribute rebound to a view of itself on every call: no state."""

    def __init__(self):
        super().__init__()
        self.table = torch.linspace(0.5, 1.5, H)

    def forward(self, x):
        self.table = self.table[:]
        return self.fc2(F.gelu(self.fc1(x)) * self.table)


# ----------------------------------------------------------------- autograd Functions, ops

class StraightThrough(torch.autograd.Function):
    """Rounds in forward, passes the gradient straight through: backward is not forward's."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class CustomFunction(MLP):
    def forward(self, x):
        return self.fc2(StraightThrough.apply(self.fc1(x)))


@torch.library.custom_op("tpcompile_tests::straight_through", mutates_args=())
def straight_through(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x * 4) / 4


@straight_through.register_fake
def _(x):
    return torch.empty_like(x)


straight_through.register_autograd(lambda ctx, grad: grad)


class CustomOp(MLP):
    """The fix for CustomFunction: a custom op with its own backward, gathered whole."""

    def forward(self, x):
        return self.fc2(straight_through(self.fc1(x)))


class ToNumpy(MLP):
    """Tensors leaving torch (to NumPy) cannot be traced."""

    def forward(self, x):
        scale = float(abs(x.detach().numpy()).max())
        return self.fc2(F.gelu(self.fc1(x))) / scale


# ----------------------------------------------------------------- shared parameters, sizes

class SharedModule(nn.Module):
    """One Linear used at two places, and a second Linear holding the same Parameter."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)
        self.up2 = nn.Linear(D, H)
        self.up2.weight = self.up.weight

    def forward(self, x):
        y = x + self.down(F.gelu(self.up(x)))
        return y + self.down(F.silu(self.up2(y)) * torch.sigmoid(self.up(y)))


class TiedTranspose(nn.Module):
    """An autoencoder: ``W^T gelu(W x)``, one parameter used column- and row-wise."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D, H, bias=False)

    def forward(self, x):
        return F.linear(F.gelu(self.enc(x)), self.enc.weight.t())


class SquareTwice(nn.Module):
    """One square Linear applied twice around an activation."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(F.gelu(self.fc(x)))


class Narrow(MLP):
    """3 hidden features: fewer than 4 ranks, so nothing to split."""

    def __init__(self):
        super().__init__(hidden=3)


class Int8Weight(nn.Module):
    """A quantized weight stored as an int8 buffer (no gradient), dequantized by a cast and
    scaled after the matmul: column-parallel like a float weight, its scale cut alike."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.register_buffer("w_q", torch.randint(-8, 8, (H, D), dtype=torch.int8))
        self.scale = nn.Parameter(torch.full((H,), 0.1))
        self.fc2 = nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(F.gelu(F.linear(x, self.w_q.to(x.dtype)) * self.scale))


class ComplexRotary(nn.Module):
    """Complex-valued rotation between the projections (like Llama's reference RoPE)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)
        angles = torch.linspace(0, 3, H // 2)
        self.register_buffer("rot", torch.polar(torch.ones(H // 2), angles))

    def forward(self, x):
        h = self.fc1(x)
        c = torch.view_as_complex(h.unflatten(-1, (-1, 2)).contiguous()) * self.rot
        return self.fc2(torch.view_as_real(c).flatten(-2))


class Embedder(nn.Module):
    """Token ids -> a vocabulary-parallel table (with ``vocab_parallel=True``) -> an MLP."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.mlp = MLP()

    def forward(self, ids):
        return self.mlp(self.emb(ids))


# name -> model class; built with torch.manual_seed(0), inputs of shape (2, 3, D)
NUMERIC = {"in_place_ops": InPlaceOps, "slice_assign": SliceAssign, "scaled_hidden": ScaledHidden,
           "running_mean": RunningMean, "batch_norm": BatchNormHidden, "custom_op": CustomOp,
           "shared_module": SharedModule, "tied_transpose": TiedTranspose,
           "square_twice": SquareTwice, "narrow": Narrow, "int8_weight": Int8Weight,
           "complex_rotary": ComplexRotary}


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = NUMERIC[name]()
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))
    return model, (x,)
