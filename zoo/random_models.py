"""Random transformer-like models built from plain-data specs, for the property-based tests.

A spec is a JSON-able dict, so the parent test process can draw specs with hypothesis and send
them to spawned gloo ranks, which rebuild the identical model (same seed, same weights) on every
rank; a spec that ever found a bug is stored as-is in ``tests/corpus/*.json`` and replayed.

Spec::

    {"seed": 3, "batch": 2, "seq": 5, "dim": 12,
     "input": "float" | "ids",  "vocab": 11,         # ids: an nn.Embedding(vocab, dim) first
     "blocks": [{"kind": "mlp", ...}, ...],
     "head": 7 | None,                               # a final Linear(dim, head)
     "dtype": "float64",                             # default float32
     "options": {"vocab_parallel": false, "sequence_parallel": false}}

Block kinds (every block maps (batch, seq, dim) -> (batch, seq, dim'), ``norm`` is a pre-norm
``"layer"`` / ``"rms"`` / None and ``residual`` adds the block's input when the dims allow):

- ``mlp``: ``hidden``, ``act``, ``bias``, ``inplace`` (relu / silu / tanh run in place)
- ``swiglu``: ``hidden``, ``bias``
- ``attention``: ``heads``, ``kv_heads``, ``head_dim``, ``fused`` (one qkv Linear, split),
  ``sdpa`` (else explicit softmax), ``causal``, ``gqa`` (``"repeat"`` or ``"sdpa"``), ``bias``
- ``tied``: ``hidden``, ``act``: up-projection W, down-projection W^T (one shared parameter)
- ``twice``: one square Linear applied twice around ``act`` (a parameter used by two matmuls)
- ``unknown``: ``hidden``: Linear -> an op without a sharding rule (cumprod) -> Linear
- ``linear``: ``out``, ``bias``: change the model dim; ``act``: ``act``; ``norm``: its pre-norm only
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tpcompile.tools.models import RMSNorm

ACTS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}
INPLACE_ACTS = {"relu": lambda x: x.relu_(), "silu": lambda x: F.silu(x, inplace=True),
                "tanh": lambda x: x.tanh_()}


def _norm(kind: str | None, dim: int) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(dim)
    if kind == "rms":
        return RMSNorm(dim)
    return nn.Identity()


class Block(nn.Module):
    """Pre-norm, the block's body, optional residual."""

    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.norm = _norm(spec.get("norm"), dim)
        self.body = BODIES[spec["kind"]](spec, dim)
        self.dim_out = self.body.dim_out
        self.residual = bool(spec.get("residual")) and self.dim_out == dim

    def forward(self, x):
        y = self.body(self.norm(x))
        return x + y if self.residual else y


class MLP(nn.Module):
    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, spec["hidden"], bias=spec.get("bias", True))
        self.down = nn.Linear(spec["hidden"], dim, bias=spec.get("bias", True))
        table = INPLACE_ACTS if spec.get("inplace") else ACTS
        self.act, self.dim_out = table[spec.get("act", "gelu")], dim

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class SwiGLU(nn.Module):
    def __init__(self, spec: dict, dim: int):
        super().__init__()
        bias = spec.get("bias", False)
        self.w1 = nn.Linear(dim, spec["hidden"], bias=bias)
        self.w3 = nn.Linear(dim, spec["hidden"], bias=bias)
        self.w2 = nn.Linear(spec["hidden"], dim, bias=bias)
        self.dim_out = dim

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.h, self.kv, self.hd = spec["heads"], spec["kv_heads"], spec["head_dim"]
        self.fused, self.sdpa = spec.get("fused", False), spec.get("sdpa", True)
        self.causal, self.gqa = spec.get("causal", True), spec.get("gqa", "repeat")
        bias = spec.get("bias", False)
        q, kv = self.h * self.hd, self.kv * self.hd
        if self.fused:
            self.qkv = nn.Linear(dim, q + 2 * kv, bias=bias)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(dim, n, bias=bias) for n in (q, kv, kv))
        self.wo = nn.Linear(q, dim, bias=bias)
        self.dim_out = dim

    def forward(self, x):
        B, T, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], 2)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(B, T, self.h, self.hd).transpose(1, 2)
        k = k.view(B, T, self.kv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.kv, self.hd).transpose(1, 2)
        gqa_in_sdpa = self.sdpa and self.gqa == "sdpa" and self.kv != self.h
        if self.kv != self.h and not gqa_in_sdpa:
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=gqa_in_sdpa)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
            if self.causal:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf"))
            y = att.softmax(-1) @ v
        return self.wo(y.transpose(1, 2).reshape(B, T, self.h * self.hd))


class Tied(nn.Module):
    """An autoencoder-style pair: ``W^T act(W x)`` with one weight."""

    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, spec["hidden"], bias=False)
        self.act, self.dim_out = ACTS[spec.get("act", "gelu")], dim

    def forward(self, x):
        return F.linear(self.act(self.up(x)), self.up.weight.t())


class Twice(nn.Module):
    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim, bias=spec.get("bias", True))
        self.act, self.dim_out = ACTS[spec.get("act", "gelu")], dim

    def forward(self, x):
        return self.fc(self.act(self.fc(x)))


class Unknown(nn.Module):
    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, spec["hidden"])
        self.down = nn.Linear(spec["hidden"], dim)
        self.dim_out = dim

    def forward(self, x):
        return self.down(torch.cumprod(torch.sigmoid(self.up(x)), -1))


class LinearBody(nn.Module):
    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, spec["out"], bias=spec.get("bias", True))
        self.dim_out = spec["out"]

    def forward(self, x):
        return self.fc(x)


class Act(nn.Module):
    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.act, self.dim_out = ACTS[spec.get("act", "gelu")], dim

    def forward(self, x):
        return self.act(x)


class Identity(nn.Module):
    """The body of a ``norm`` block: the block's pre-norm is all it does."""

    def __init__(self, spec: dict, dim: int):
        super().__init__()
        self.dim_out = dim

    def forward(self, x):
        return x


BODIES = {"mlp": MLP, "swiglu": SwiGLU, "attention": Attention, "tied": Tied, "twice": Twice,
          "unknown": Unknown, "linear": LinearBody, "act": Act, "norm": Identity}


class RandomModel(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        dim = spec["dim"]
        self.embed = nn.Embedding(spec["vocab"], dim) if spec["input"] == "ids" else None
        blocks = []
        for b in spec["blocks"]:
            blocks.append(Block(b, dim))
            dim = blocks[-1].dim_out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, spec["head"], bias=False) if spec.get("head") else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def build(spec: dict) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (seeded: identical on every rank) and one example input for ``spec``.

    ``spec["dtype"]`` (default ``"float32"``) is the parameters' and float inputs' dtype.
    """
    dtype = getattr(torch, spec.get("dtype", "float32"))
    torch.manual_seed(spec["seed"])
    model = RandomModel(spec).to(dtype)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    shape = (spec["batch"], spec["seq"])
    if spec["input"] == "ids":
        x = torch.randint(0, spec["vocab"], shape, generator=gen)
    else:
        x = torch.randn(shape + (spec["dim"],), generator=gen, dtype=dtype)
    return model, (x,)


def options(spec: dict) -> dict:
    return dict(spec.get("options", {}))


# ----------------------------------------------------------------- hypothesis strategies

def _strategies():
    """Imported lazily: spawned ranks rebuild models from specs and never draw them."""
    from hypothesis import strategies as st

    sizes = st.integers(1, 40)
    acts = st.sampled_from(sorted(ACTS))
    norms = st.sampled_from([None, "layer", "rms"])

    @st.composite
    def attention(draw):
        heads = draw(st.integers(1, 6))
        kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
        return {"heads": heads, "kv_heads": kv, "head_dim": draw(st.integers(1, 6)),
                "fused": draw(st.booleans()), "sdpa": draw(st.booleans()),
                "causal": draw(st.booleans()), "gqa": draw(st.sampled_from(["repeat", "sdpa"])),
                "bias": draw(st.booleans())}

    @st.composite
    def block(draw):
        kind = draw(st.sampled_from(sorted(BODIES)))
        spec = {"kind": kind, "norm": draw(norms), "residual": draw(st.booleans())}
        if kind == "mlp":
            inplace = draw(st.booleans())
            spec.update(hidden=draw(sizes), bias=draw(st.booleans()), inplace=inplace,
                        act=draw(st.sampled_from(sorted(INPLACE_ACTS)) if inplace else acts))
        elif kind in ("swiglu", "unknown"):
            spec.update(hidden=draw(sizes), bias=draw(st.booleans()))
        elif kind == "attention":
            spec.update(draw(attention()))
        elif kind in ("tied", "twice", "act"):
            spec.update(hidden=draw(sizes), act=draw(acts), bias=draw(st.booleans()))
        elif kind == "linear":
            spec.update(out=draw(st.integers(1, 24)), bias=draw(st.booleans()))
        return spec

    @st.composite
    def model(draw, max_blocks: int = 4):
        ids = draw(st.booleans())
        spec = {"seed": draw(st.integers(0, 2**16)), "batch": draw(st.integers(1, 3)),
                "seq": draw(st.integers(1, 6)), "dim": draw(st.integers(2, 24)),
                "input": "ids" if ids else "float", "vocab": draw(st.integers(2, 40)),
                "blocks": draw(st.lists(block(), min_size=1, max_size=max_blocks)),
                "head": draw(st.one_of(st.none(), st.integers(2, 40))),
                "options": {"vocab_parallel": ids and draw(st.booleans()),
                            "sequence_parallel": draw(st.sampled_from([False, False, True]))}}
        return spec

    return model


def specs(max_blocks: int = 4):
    """A hypothesis strategy of model specs (see the module docstring)."""
    return _strategies()(max_blocks)


def draw(n: int, seed: int, max_blocks: int = 4) -> list[dict]:
    """``n`` specs drawn by hypothesis from a fixed seed: the same list on every run (CI)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    drawn: list[dict] = []

    @fixed_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(specs(max_blocks))
    def collect(spec):
        drawn.append(spec)

    collect()
    return drawn


CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"


def corpus() -> dict[str, dict]:
    """Specs that once found a bug: ``tests/corpus/<name>.json`` -> {world_size, found, spec}."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(CORPUS.glob("*.json"))}
