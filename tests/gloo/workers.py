"""Rank-side test bodies. The launcher imports this file by path in each spawned rank.

Each worker runs many cases in one process group and returns plain data per case (errors are
returned as strings, not raised), so that one spawn serves a whole parametrized test module.
"""

from __future__ import annotations

import math
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.tools import models
from tpcompile.tools.numerics import compare, rel_err, saved_activation_bytes
from zoo.hf_models import hf_inputs, hf_model


class UnruledOpAttention(nn.Module):
    """Explicit attention with an op tpcompile has no rule for on the head-sharded scores."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.cumprod(torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(C // self.heads)), -1)
        y = att.softmax(-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


class MergedHeadsUnruledOp(UnruledOpAttention):
    """Batch and heads merged (``reshape(B * H, T, d)``: BART's bmm attention) with a dynamic
    batch, and an op without a sharding rule on the merged scores: they are gathered tile by
    tile, and cut again where they meet the head-sharded values."""

    def forward(self, x):
        B, T, C = x.shape
        H, d = self.heads, C // self.heads
        q, k, v = (t.view(B, T, H, d).transpose(1, 2).reshape(B * H, T, d)
                   for t in self.qkv(x).split(C, dim=2))
        att = torch.cumprod(torch.sigmoid(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)), -1)
        y = torch.bmm(att.softmax(-1), v).view(B, H, T, d)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


class GroupsRepeatedToHeads(nn.Module):
    """Mamba-2's B and C: 4 groups repeated to 8 heads by ``repeat_interleave(..., dim=2,
    output_size=8)``, multiplied into the heads of another projection; cut by groups, the
    promised ``output_size`` is the rank's."""

    def __init__(self, dim=32, groups=4, heads=8, head_dim=4):
        super().__init__()
        self.groups, self.heads, self.head_dim = groups, heads, head_dim
        self.b = nn.Linear(dim, groups * head_dim, bias=False)
        self.x = nn.Linear(dim, heads * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, dim, bias=False)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        B, T, _ = x.shape
        b = self.b(x).view(B, T, self.groups, self.head_dim)
        b = b.repeat_interleave(self.heads // self.groups, dim=2, output_size=self.heads)
        y = self.x(x).view(B, T, self.heads, self.head_dim) * torch.sigmoid(b)
        return x + self.out(y.reshape(B, T, -1))


class WholeKVReadWhole(nn.Module):
    """GPT-BigCode's fused qkv with one kv head, which every rank computes whole for its query
    heads, and whose key also feeds the residual stream: there every rank differentiates it
    whole, and the chain's gradient sync would count that gradient once per rank. The fused
    weight stays replicated."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim + 2 * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        B, T, C = x.shape
        H, d = self.heads, self.head_dim
        q, k, v = self.qkv(x).split([C, d, d], dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(
            q.view(B, T, H, d).transpose(1, 2),
            *(t.view(B, T, 1, d).transpose(1, 2).expand(B, H, T, d) for t in (k, v)), is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C)) + k.mean(-1, keepdim=True)


class FreshBufferKeys(nn.Module):
    """MLA's ``expand_kv``: each head's key is its own part and a part every head shares,
    written into a ``new_empty`` buffer by ``copy_`` into slices (the shared part broadcast)."""

    def __init__(self, dim=32, heads=4, own=6, shared=2):
        super().__init__()
        self.heads, self.own, self.head_dim = heads, own, own + shared
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_own = nn.Linear(dim, heads * own, bias=False)
        self.k_shared = nn.Linear(dim, shared, bias=False)
        self.v = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        B, T, _ = x.shape
        H, D = self.heads, self.head_dim
        q = self.q(x).view(B, T, H, D).transpose(1, 2)
        v = self.v(x).view(B, T, H, D).transpose(1, 2)
        own = self.k_own(x).view(B, T, H, self.own).transpose(1, 2)
        shared = self.k_shared(x).view(B, T, 1, D - self.own).transpose(1, 2)
        k = own.new_empty(B, H, T, D)
        k[..., :self.own].copy_(own)
        k[..., self.own:].copy_(shared)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, H * D))


class FreshBufferIndexAdd(nn.Module):
    """Rows routed by sign to one of two MLPs (no output bias, as MoE experts), accumulated
    by ``index_add_`` into zeros."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(),
                                                nn.Linear(hidden, dim, bias=False)) for _ in range(2))
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        out = torch.zeros_like(flat)
        positive = flat.sum(-1) > 0
        for i, mlp in enumerate(self.mlps):
            (rows,) = torch.where(positive == bool(i))
            out.index_add_(0, rows, mlp(flat.index_select(0, rows)))
        return x + out.view(B, T, C)


class RotaryWrittenIntoSlice(nn.Module):
    """CogView4's attention: per-head LayerNorm on q and k, ``.to(dtype)`` of their own dtype
    (the same tensor), then rotary written in place into the image tokens' slice
    (``q[:, :, text:, :] = rotate(q[:, :, text:, :])``)."""

    def __init__(self, dim=32, heads=4, text=3):
        super().__init__()
        self.heads, self.text = heads, text
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = nn.LayerNorm(dim // heads), nn.LayerNorm(dim // heads)
        self.o = nn.Linear(dim, dim)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        q, k, v = (p(x).unflatten(2, (self.heads, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self.norm_q(q).to(dtype=x.dtype), self.norm_k(k).to(dtype=x.dtype)
        t = self.text
        q[:, :, t:, :] = torch.cat([-q[:, :, t:, 1::2], q[:, :, t:, ::2]], -1) * 0.5 + q[:, :, t:, :]
        k[:, :, t:, :] = torch.cat([-k[:, :, t:, 1::2], k[:, :, t:, ::2]], -1) * 0.5 + k[:, :, t:, :]
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(y.transpose(1, 2).flatten(2))



class AttentionBackwardInTime(nn.Module):
    """SANA-WM's bidirectional pass: attention over the frames as given and again over the
    frames flipped in time (``torch.flip(q, dims=[2])``), the second flipped back and added."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        # no biases: k's gradient is zero in exact arithmetic (softmax ignores a shift shared
        # by every key), and AdamW's steps would magnify its rounding
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        q, k, v = (p(x).unflatten(2, (self.heads, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        back = sdpa(*(torch.flip(t, dims=[2]) for t in (q, k, v)), is_causal=True)
        y = sdpa(q, k, v, is_causal=True) + torch.flip(back, dims=[2])
        return x + self.o(y.transpose(1, 2).flatten(2))


class HiddenScaledByAttribute(nn.Module):
    """A column-parallel output scaled by a table kept as a plain tensor attribute (no
    parameter, no buffer), which export lifts as a constant of the graph, as SANA-WM's refiner
    keeps its tables: the plan cuts the table with the features, so each rank holds its slice."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.table = torch.linspace(0.5, 1.5, hidden)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * self.table)


class _Stream(nn.Module):
    """One token stream's weights in a joint-attention block: a norm, q / k / v and out."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))


class JointStreamsCaptioned(nn.Module):
    """Joint attention (MMDiT, JoyImage, Motif) over the image tokens and context tokens that
    a caption projection (Linear-GELU-Linear, a column -> row chain) makes from the input: the
    context stream's q / k / v input is computed from a reader of the input, which requires no
    gradient, so its gradient sync (one that never runs) must not share a bucket with the two
    streams' q / k / v inputs, whose syncs are one all-reduce."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.cap1, self.cap2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.image, self.context = _Stream(dim), _Stream(dim)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        c = self.cap2(F.gelu(self.cap1(x)))
        qkv = [[p(s.norm(t)).unflatten(2, (self.heads, -1)).transpose(1, 2) for p in (s.q, s.k, s.v)]
               for s, t in ((self.image, x), (self.context, c))]
        q, k, v = (torch.cat(pair, dim=2) for pair in zip(*qkv))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        n = x.shape[1]
        return x + self.image.out(y[:, :n]) + (c + self.context.out(y[:, n:])).mean(1, keepdim=True)


class OneHeadAttention(nn.Module):
    """A one-head attention written out (diffusers' ``SelfAttention1d`` in UNet1D, a VAE's
    mid-block attention): ``softmax(q @ k^T) @ v``. Cutting q and k along the head's features
    makes the scores a partial sum, a T x T all-reduce; the plan keeps q and k whole and cuts
    v's features and ``o``'s rows (probs @ v is per feature): one all-reduce each way."""

    def __init__(self, dim=32):
        super().__init__()
        # k without a bias: its gradient is zero in exact arithmetic (softmax ignores a shift
        # shared by every key), and AdamW's steps would magnify its rounding
        self.q, self.v, self.o = (nn.Linear(dim, dim) for _ in range(3))
        self.k = nn.Linear(dim, dim, bias=False)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        q, k, v = (p(x).unsqueeze(1) for p in (self.q, self.k, self.v))  # (B, 1, T, D)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        return x + self.o((probs @ v).squeeze(1))


class LatentAttention(nn.Module):
    """MLA whose latent is no narrower than the model (torchtitan's DeepSeek-V3 debug config):
    ``wkv_a`` makes a latent and a rope piece, the latent is normalized and expanded 4x into
    heads by ``wkv_b``. The down projection stays whole, ``wq`` / ``wkv_b`` are cut by heads,
    ``wo`` by rows; the rope piece's and the latent's partial gradients are synced in q's
    input's bucket: one all-reduce each way."""

    def __init__(self, dim=32, heads=4, latent=32, rope=8, head=16, max_len=64):
        super().__init__()
        self.heads, self.rope, self.head = heads, rope, head
        self.norm, self.kv_norm = models.RMSNorm(dim), models.RMSNorm(latent)
        self.wq = nn.Linear(dim, heads * (head + rope), bias=False)
        self.wkv_a = nn.Linear(dim, latent + rope, bias=False)
        self.wkv_b = nn.Linear(latent, heads * 2 * head, bias=False)  # 4x the latent
        self.wo = nn.Linear(heads * head, dim, bias=False)
        angles = torch.outer(torch.arange(max_len), 0.5 ** torch.arange(rope // 2))
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def _rotate(self, x):
        half, t = x.shape[-1] // 2, x.shape[1]
        turned = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * self.cos[:t, None] + turned * self.sin[:t, None]

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, t, self.heads, -1)
        q = torch.cat([q[..., :self.head], self._rotate(q[..., self.head:])], -1)
        latent, pe = self.wkv_a(h).split([self.kv_norm.weight.shape[0], self.rope], -1)
        pe = self._rotate(pe.unsqueeze(2)).expand(-1, -1, self.heads, -1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, t, self.heads, 2 * self.head)
        k = torch.cat([kv[..., :self.head], pe], -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             kv[..., self.head:].transpose(1, 2), is_causal=True)
        return x + self.wo(out.transpose(1, 2).reshape(b, t, -1))


class _ResidualMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _CrossBlock(nn.Module):
    """Cross-attention from the image tokens to the text stream's output, then an MLP."""

    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(dim)
        self.q, self.v, self.o = (nn.Linear(dim, dim) for _ in range(3))
        # k without a bias: its gradient is zero in exact arithmetic (softmax ignores a shift
        # shared by every key), and AdamW's steps would magnify its rounding
        self.k = nn.Linear(dim, dim, bias=False)
        self.mlp = _ResidualMlp(dim, hidden)

    def forward(self, x, text):
        b = x.shape[0]
        q, k, v = (p(s).view(b, -1, self.heads, x.shape[-1] // self.heads).transpose(1, 2)
                   for p, s in ((self.q, self.norm(x)), (self.k, text), (self.v, text)))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        return self.mlp(x + self.o(y))


class TextThenImageBlocks(nn.Module):
    """A text stream through its own blocks, then image blocks that each read its output in
    cross-attention (Kandinsky 5's text and visual blocks). The text output's gradient is
    whole once the first image block's backward has run: its sync shares that block's first
    all-reduce (keyed by the text block that made it, it paid one of its own)."""

    def __init__(self, dim=32, heads=4, hidden=64):
        super().__init__()
        self.text = nn.ModuleList(_ResidualMlp(dim, hidden) for _ in range(2))
        self.image = nn.ModuleList(_CrossBlock(dim, heads, hidden) for _ in range(2))
        self.cfg = models.ModelConfig(dim=dim, n_layers=2)

    def forward(self, x):
        text = x.flip(1)
        for block in self.text:
            text = block(text)
        for block in self.image:
            x = block(x, text)
        return x


class TextEncodedOutsideTheBlocks(TextThenImageBlocks):
    """The text stream made by one MLP outside any block list (Wan's and AnyFlow's text
    embedder), its output read by each image block's cross-attention: its gradient sync serves
    no one block and is counted with the code that made it, as the bound counts it (counted
    under the last block that read it, that block was one backward above the bound)."""

    def __init__(self, dim=32, heads=4, hidden=64):
        super().__init__(dim, heads, hidden)
        self.text = _ResidualMlp(dim, hidden)

    def forward(self, x):
        text = self.text(x.flip(1))
        for block in self.image:
            x = block(x, text)
        return x


class TwoStreamsInTurn(nn.Module):
    """Two token streams, each through two residual MLPs, the first stream's both before the
    second's (LTX-2's video, then audio): the MLP inputs of the streams' first sublayers wait
    on none of each other, nor do their second sublayers', so two backward all-reduces serve
    all four; bucketed greedily in graph order, the second stream's first input joined the
    first stream's second bucket and its second input paid a third."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(4))
        self.down = nn.ModuleList(nn.Linear(hidden, dim) for _ in range(4))
        self.cfg = models.ModelConfig(dim=dim, n_layers=1)

    def forward(self, x):
        streams = [x, x.flip(1)]
        for s in range(2):
            for i in (2 * s, 2 * s + 1):
                h = streams[s]
                streams[s] = h + self.down[i](F.gelu(self.up[i](self.norm(h))))
        return streams[0] + streams[1]


# name -> (built-in model name or a module class, config overrides)
CASES = {
    "mlp": ("mlp", {}),
    "gpt2": ("gpt2", {}),
    "gpt2_explicit_attention": ("gpt2", {"sdpa": False}),
    "llama": ("llama", {}),
    "llama_explicit_attention": ("llama", {"sdpa": False}),
    # indivisible everything: 6 heads of 8, 2 kv heads, hidden 100, vocab 97
    "llama_uneven": ("llama", {"dim": 48, "n_heads": 6, "n_kv_heads": 2, "hidden": 100, "vocab": 97}),
    "mlp_uneven": ("mlp", {"dim": 20, "hidden": 30}),
    # the scores go through an op without a sharding rule: gathered there, still exact
    "unknown_op_fallback": (UnruledOpAttention, {}),
    "merged_heads_fallback": (MergedHeadsUnruledOp, {}),
    "groups_repeated_to_heads": (GroupsRepeatedToHeads, {}),
    "whole_kv_read_whole": (WholeKVReadWhole, {}),
    # in-place writes into buffers the model makes itself, planned out of place
    "fresh_buffer_copy": (FreshBufferKeys, {}),
    "fresh_buffer_index_add": (FreshBufferIndexAdd, {}),
    "rotary_written_into_slice": (RotaryWrittenIntoSlice, {}),
    "attention_backward_in_time": (AttentionBackwardInTime, {}),
    "hidden_scaled_by_attribute": (HiddenScaledByAttribute, {}),
    "joint_streams_captioned": (JointStreamsCaptioned, {}),
    "one_head_attention": (OneHeadAttention, {}),
    "two_streams_in_turn": (TwoStreamsInTurn, {}),
    "latent_attention": (LatentAttention, {}),
    "text_then_image_blocks": (TextThenImageBlocks, {}),
    "text_encoded_outside_the_blocks": (TextEncodedOutsideTheBlocks, {}),
}


def _run_case(name: str) -> dict:
    model_name, overrides = CASES[name]
    if isinstance(model_name, str):
        model = models.build(model_name, **overrides)
        inputs = models.example_inputs(model)
    else:
        torch.manual_seed(0)
        model = model_name(**overrides)
        inputs = (torch.randn(2, 8, model.cfg.dim),)
    tp = tpcompile.parallelize(model, inputs)
    result = compare(model, tp, inputs, steps=3)
    return {
        "output_err": result.output_err,
        "grad_errs": result.grad_errs,
        "step_errs": result.step_errs,
        "collectives": result.collectives,
        "styles": tp.plan.styles(),
        "reasons": {n: p.reason for n, p in tp.plan.params.items()},
        "local_shapes": {n: tuple(p.shape) for n, p in tp.named_parameters()},
        "n_layers": model.cfg.n_layers,
        "fallbacks": tp.plan.fallbacks,
    }


def numerics(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = _run_case(name)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
    return out


def dynamic_shapes(rank: int, world_size: int) -> dict:
    """One parallelized module called with other batch sizes and sequence lengths."""
    model = models.build("llama")
    tp = tpcompile.parallelize(model, models.example_inputs(model, batch=2, seq=16))
    errs = {}
    for batch, seq in [(2, 16), (3, 16), (2, 24), (3, 24), (1, 5)]:
        x = models.example_inputs(model, batch=batch, seq=seq, seed=batch * 100 + seq)
        errs[(batch, seq)] = (tp(*x) - model(*x)).abs().max().item() / model(*x).abs().max().item()
    return errs


def plan_mismatch(rank: int, world_size: int) -> str:
    """Rank 1 builds a different model: every rank must raise before any model collective."""
    model = models.build("mlp", hidden=128 if rank == 0 else 96)
    try:
        tpcompile.parallelize(model, models.example_inputs(model))
    except tpcompile.PlanMismatchError as e:
        return str(e)
    return "no error"


def mesh_checks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model = models.build("mlp")
    inputs = models.example_inputs(model)
    out = {}
    mesh = init_device_mesh("cpu", (world_size,))
    tp = tpcompile.parallelize(model, inputs, mesh=mesh)
    out["mesh_1d_err"] = (tp(*inputs) - model(*inputs)).abs().max().item()
    try:
        tpcompile.parallelize(model, inputs, mesh=init_device_mesh("cpu", (2, world_size // 2)))
        out["mesh_2d"] = "no error"
    except tpcompile.MeshError as e:
        out["mesh_2d"] = str(e)
    return out


def world_size_one(rank: int, world_size: int) -> dict:
    model = models.build("llama")
    inputs = models.example_inputs(model)
    tp = tpcompile.parallelize(model, inputs)
    return {"styles": set(tp.plan.styles().values()),
            "collectives": compare(model, tp, inputs).collectives,
            "err": (tp(*inputs) - model(*inputs)).abs().max().item()}


def untouched_model(rank: int, world_size: int) -> dict:
    """parallelize leaves the model as it was and shares no storage with it."""
    model = models.build("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {t.data_ptr() for t in model.state_dict().values()}
    tp = tpcompile.parallelize(model, models.example_inputs(model))
    x = models.example_inputs(model)
    tp(*x).sum().backward()
    torch.optim.SGD(tp.parameters(), lr=0.1).step()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    shared = [n for n, t in tp.state_dict().items() if t.data_ptr() in ptrs]
    return {"changed": changed, "shared": shared, "keys_equal": set(tp.state_dict()) == set(before)}


# ----------------------------------------------------------------- vocabulary parallelism

class WithLoss(nn.Module):
    """A language model with its loss traced in: ``forward(ids, labels) -> loss``."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        logits = self.lm(ids)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _labels(ids):
    labels = ids.roll(-1, 1).clone()
    labels[:, -1] = -100  # ignored
    return labels


def _vocab_case(name: str) -> dict:

    if name in ("llama_vocab_parallel", "gpt2_vocab_parallel", "gpt2_vocab_sequence_parallel"):
        model = models.build(name.split("_")[0], vocab=97)
        x = models.example_inputs(model)
        tp = tpcompile.parallelize(model, x, vocab_parallel=True,
                                   sequence_parallel=name.endswith("sequence_parallel"))
        return {"cmp": compare(model, tp, x, steps=3), "plan": tp.plan}
    if name in ("gpt2_traced_loss", "llama_traced_loss"):
        model = WithLoss(models.build(name.split("_")[0], vocab=97))
        ids = models.example_inputs(model.lm)[0]
        x = (ids, _labels(ids))
        tp = tpcompile.parallelize(model, x)
        return {"cmp": compare(model, tp, x, steps=3), "plan": tp.plan}
    assert name == "llama_loss_parallel"
    model = models.build("llama", vocab=97)
    ids = models.example_inputs(model)[0]
    tp = tpcompile.parallelize(model, (ids,), loss_parallel=True, vocab_parallel=True)
    ref = __import__("copy").deepcopy(model)
    labels = _labels(ids)
    ref_loss = torch.nn.functional.cross_entropy(ref(ids).flatten(0, 1), labels.flatten())
    local = tp(ids)
    loss = tpcompile.sharded_cross_entropy(tp, local, labels)
    ref_loss.backward()
    loss.backward()
    grads = tp.full_grads()
    return {"loss_err": rel_err(loss, ref_loss), "local_shape": tuple(local.shape),
            "grad_errs": {n: rel_err(grads[n], p.grad) for n, p in ref.named_parameters()},
            "plan": tp.plan}


def vocab(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = _vocab_case(name)
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc()}
    return out


def _dropout_models():
    """GPT-2 with explicit dropout, with SDPA's own, and a GPT-J-style parallel block whose
    partial sums pass through their dropouts (zoo.idioms ``parallel_block_dropped_out``)."""
    from functools import partial

    from zoo import idioms
    from zoo.idioms.blocks import ParallelDroppedOut
    from zoo.idioms.diffusion import GeluMLP
    from zoo.idioms.skeleton import LM

    for sdpa in (False, True):
        model = models.build("gpt2", dropout=0.1, sdpa=sdpa, vocab=97)
        yield "sdpa" if sdpa else "explicit", model, models.example_inputs(model)
    torch.manual_seed(0)
    model = LM(mlp=GeluMLP, block=partial(ParallelDroppedOut, p=0.1))
    yield "parallel_block", model, idioms.example_inputs()


def dropout(rank: int, world_size: int) -> dict:
    """Train-mode dropout: explicit dropout is exactly the unsharded model's (same seed), a
    partial sum's too; SDPA's internal dropout keeps replicas and the default generator
    consistent."""
    import copy
    import torch.distributed as dist
    from tpcompile.runtime.collectives import count_collectives

    out = {}
    for name, model, x in _dropout_models():
        model.train()
        tp = tpcompile.parallelize(model, x)
        ref = copy.deepcopy(model)
        torch.manual_seed(123)
        o_ref = ref(*x)
        torch.manual_seed(123)
        o = tp(*x)
        state = torch.get_rng_state()
        o.pow(2).sum().backward()
        o_ref.pow(2).sum().backward()
        grads = tp.full_grads()
        outs = [torch.empty_like(o) for _ in range(world_size)]
        dist.all_gather(outs, o.detach().contiguous())
        states = [torch.empty_like(state) for _ in range(world_size)]
        dist.all_gather(states, state)
        out[name] = {
            "collectives": count_collectives(tp.graph_module),
            "output_err": rel_err(o, o_ref),
            "grad_err": max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters()),
            "replicas_equal": all(torch.equal(outs[0], t) for t in outs),
            "rng_equal": all(torch.equal(states[0], t) for t in states),
        }
    return out


# ----------------------------------------------------------------- Hugging Face models

def _hf_case(name: str, with_labels: bool) -> dict:
    model = hf_model(name).eval()
    ids, kw = hf_inputs(model)
    if not with_labels:
        tp = tpcompile.parallelize(model, (ids,), example_kwargs=kw)
        cmp = compare(model, tp, (ids,), kwargs=kw)
        with torch.no_grad():  # every output, not only the first (an encoder's last state too)
            outputs_err = max(rel_err(a, b) for a, b in zip(_floats(tp(ids, **kw)),
                                                            _floats(model(ids, **kw))))
        return {"output_err": cmp.output_err, "grad_errs": cmp.grad_errs,
                "outputs_err": outputs_err,
                "collectives": cmp.collectives, "styles": tp.plan.styles(),
                "notes": tp.plan.notes, "use_cache_after": getattr(model.config, "use_cache", None),
                "reused": tp.reused_blocks}
    kw["labels"] = ids.clone()
    tp = tpcompile.parallelize(model, (ids,), example_kwargs=kw, loss_parallel=True,
                               vocab_parallel=True)
    ref = __import__("copy").deepcopy(model)
    out_ref, out = ref(ids, **kw), tp(ids, **kw)
    out_ref.loss.backward()
    out.loss.backward()
    grads = tp.full_grads()
    floor = 1e-3 * max(p.grad.abs().max().item() for p in ref.parameters())
    return {"loss_err": rel_err(out.loss, out_ref.loss), "logits_shape": tuple(out.logits.shape),
            "grad_errs": {n: rel_err(grads[n], p.grad, floor) for n, p in ref.named_parameters()},
            "styles": tp.plan.styles()}


def _floats(out) -> list:
    """The floating tensors of a model's output (tuples, dicts, HF ModelOutputs), in order."""
    return [t for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def hf(rank: int, world_size: int, cases: list[tuple[str, bool]]) -> dict:
    out = {}
    for name, with_labels in cases:
        try:
            out[(name, with_labels)] = _hf_case(name, with_labels)
        except Exception:  # noqa: BLE001
            out[(name, with_labels)] = {"error": traceback.format_exc()}
    return out


# ----------------------------------------------------------------- sequence parallelism

def sequence_parallel(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        try:
            model = models.build(name)
            x = models.example_inputs(model, seq=32)
            tp = tpcompile.parallelize(model, x, sequence_parallel=True)
            plain = tpcompile.parallelize(model, x)
            cmp = compare(model, tp, x, steps=3)
            out[name] = {"cmp": cmp, "n_layers": model.cfg.n_layers,
                         "saved_sp": saved_activation_bytes(tp, x),
                         "saved_tp": saved_activation_bytes(plain, x),
                         "saved_full": saved_activation_bytes(model, x)}
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc()}
    return out


class InferredHeadsBlock(nn.Module):
    """A Llama-style block whose views take the head count from the tensor (``-1``).

    PyTorch's ``parallelize_module`` runs the model's own code on local shards, so it can only
    shard attention written this way; tpcompile rewrites hard-coded head counts instead.
    """

    def __init__(self, dim=32, heads=4, kv_heads=2, hidden=48):
        super().__init__()
        self.head_dim, self.n_rep = dim // heads, heads // kv_heads
        self.attention_norm = models.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = models.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.n_rep, 1)
        v = self.wv(h).view(B, T, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.n_rep, 1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class InferredHeadsStack(nn.Module):
    def __init__(self, n_layers=2, dim=32):
        super().__init__()
        self.dim = dim
        self.layers = nn.ModuleList(InferredHeadsBlock(dim) for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def dtensor_case(name: str):
    """(model, example inputs) for the parallelize_module equivalence test."""
    torch.manual_seed(0)
    if name == "inferred_heads":
        model = InferredHeadsStack(n_layers=1)
        return model, (torch.randn(2, 8, model.dim),)
    model = models.build(name, n_layers=1)
    return model, models.example_inputs(model)


def dtensor_equivalence(rank: int, world_size: int, names: list[str]) -> dict:
    """explain(...).to_dtensor_plan() applied with parallelize_module vs the unsharded model."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module


    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in names:
        try:
            model, inputs = dtensor_case(name)
            report = tpcompile.explain(model, inputs, world_size)
            plan = report.to_dtensor_plan()
            ref = copy.deepcopy(model)
            dt = parallelize_module(copy.deepcopy(model), mesh, plan)
            tp = tpcompile.parallelize(model, inputs)
            y_ref, y_dt = ref(*inputs), dt(*inputs)
            y_ref.pow(2).sum().backward()
            y_dt.pow(2).sum().backward()
            grads, same_shards = {}, {}
            for n, p in ref.named_parameters():
                q = dt.get_parameter(n)
                g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
                grads[n] = rel_err(g, p.grad)
                if isinstance(q, DTensor) and q.placements[0].is_shard():
                    same_shards[n] = torch.equal(q.to_local(), tp.get_parameter(n).detach())
            out[name] = {
                "plan": {m: type(s).__name__ for m, s in plan.items()},
                "not_expressible": sorted(report.not_expressible),
                "output_err": rel_err(y_dt, y_ref),
                "vs_tpcompile": rel_err(y_dt, tp(*inputs)),
                "grad_errs": grads,
                "same_shards": same_shards,
            }
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
    return out


# --------------------------------------------------------------------------- torch.compile
# One spawn per world size runs every compile check (test_compile.py): compiling costs seconds
# per graph on 2 cores, so the models are tiny and each graph is compiled once.

def tiny(name: str, layers: int = 1) -> nn.Module:
    return models.build(name, n_layers=layers, dim=32, hidden=64, n_heads=4, n_kv_heads=2)


class Branchy(nn.Module):
    """Linear -> GELU -> Linear with a Python `if` on a tensor's value in between."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        if h.sum() > 0:  # data-dependent: Dynamo splits the fc1 -> fc2 chain here
            h = h * 2
        return self.fc2(h)


class BackendView:
    """What ``compare`` needs of a model compiled with the backend: calls go through the
    compiled model, everything else (full_grads, parameters, ...) to the TPModule swapped in."""

    def __init__(self, step, model):
        self.step, self.model = step, model

    def __call__(self, *args):
        return self.step(*args)

    def __getattr__(self, name):
        return getattr(tpcompile.parallelized(self.model), name)


def _phases(codes: list[str]) -> dict:
    from tpcompile.compile.inductor import collectives_in_code, subgraph_calls

    fw = [c for c in codes if "tangents_" not in c]
    bw = [c for c in codes if "tangents_" in c]
    return {"n_codes": len(codes), "forward": collectives_in_code(fw[0]) if fw else None,
            "backward": collectives_in_code(bw[0]) if bw else None,
            "in_flight": matmuls_in_flight(bw[0]) if bw else [],
            "compiled_block_bodies": [subgraph_calls(c) for c in fw[:1] + bw[:1]]}


def matmuls_in_flight(code: str) -> list[int]:
    """Per collective of a generated module: matmuls issued before its result is waited for."""
    out, open_ = [], []
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("torch.ops._c10d_functional.wait_tensor"):
            if open_:
                out.append(open_.pop(0))
        elif line.startswith("torch.ops._c10d_functional."):
            open_.append(0)
        elif line.startswith(("extern_kernels.mm(", "extern_kernels.addmm(", "extern_kernels.bmm(")):
            open_ = [n + 1 for n in open_]
    return out


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _calls_at_shapes(step, model, shapes) -> dict:
    """(batch, seq) -> (error vs the unsharded model, graphs compiled by that call)."""
    out = {}
    for b, s in shapes:
        x = models.example_inputs(model, b, s, seed=b * 100 + s)
        before = _graphs()
        y = step(*x)
        out[(b, s)] = (rel_err(y, model(*x)), _graphs() - before)
    return out


def _comparison(result) -> dict:
    return {"output_err": result.output_err, "grad_errs": result.grad_errs,
            "step_errs": result.step_errs, "planned": result.collectives}


def _compiled_tp(name: str, dynamic: bool, overlap: bool | None, layers: int = 1) -> dict:
    """Path 1: torch.compile(parallelize(model), fullgraph=True): code, shapes, 3 AdamW steps.

    With ``dynamic`` the first call's dims are marked: other batch sizes and sequence lengths
    reuse its graph. Without, repeated calls at the compiled shape reuse it.
    """
    from torch._inductor.utils import run_and_get_code

    model = tiny(name, layers)
    inputs = models.example_inputs(model, 2, 8)
    tp = tpcompile.parallelize(model, inputs)
    tp.compiled_blocks = layers > 1
    if dynamic:
        tpcompile.mark_dynamic(tp, *inputs)
    step = torch.compile(tp, fullgraph=True,
                         options=tpcompile.compile_options(overlap,
                                                           compiled_blocks=tp.compiled_blocks))
    _, codes = run_and_get_code(compare, model, step, inputs)
    shapes = [(2, 8), (3, 8), (2, 12), (4, 16), (1, 8), (1, 5)] if dynamic else [(2, 8), (2, 8)]
    out = {**_phases(codes), "calls": _calls_at_shapes(step, model, shapes),
           "compiled_block_calls": tp.compiled_block_calls}
    tp.zero_grad()
    return {**out, **_comparison(compare(model, step, inputs, steps=3))}


def _compiled_by_backend(name: str, backend, layers: int = 1) -> dict:
    """Path 2: torch.compile(model, backend=...): first call exact, then 3 AdamW steps."""
    import copy
    import gc
    import weakref

    from torch._inductor.utils import run_and_get_code

    model = tiny(name, layers)
    reference = copy.deepcopy(model)
    inputs = models.example_inputs(model, 2, 8)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    originals = [weakref.ref(p) for p in model.parameters()]
    graphs = _graphs()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # built too early: must refuse to step
    step = torch.compile(model, backend=backend)
    first = step(*inputs)
    first.float().pow(2).sum().backward()
    try:
        stale.step()
        refused = "stepped"
    except tpcompile.TPCompileError as e:
        refused = str(e)
    ref = reference(*inputs)
    ref.float().pow(2).sum().backward()
    tp = tpcompile.parallelized(model)
    grads = tp.full_grads()
    first_errs = {"output": rel_err(first, ref)}
    first_errs.update({n: rel_err(grads[n], p.grad) for n, p in reference.named_parameters()})
    model.zero_grad()
    reference.zero_grad()
    del stale
    gc.collect()
    result, codes = run_and_get_code(compare, reference, BackendView(step, model), inputs, 3)
    local = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    named = dict(model.named_parameters())
    planned = {n: p.local_shapes[tp.rank] for n, p in tp.plan.params.items()
               if any(a in named for a in p.aliases)}  # tied weights: one entry, two names
    return {**_comparison(result), **_phases(codes), "first_errs": first_errs,
            "graphs": _graphs() - graphs, "param_bytes": sum(local.values()),
            "planned_bytes": sum(math.prod(s) * 4 for s in planned.values()),
            "full_bytes": full_bytes, "originals_alive": sum(r() is not None for r in originals),
            "stale_optimizer": refused,
            "report": [str(r) for r in backend_report(backend)]}


def compiled_blocks(rank: int, world_size: int, name: str, paths: list[str]) -> dict:
    """Compile paths (``tp``, ``backend``) on ``name`` with two identical blocks (one compiled
    block); the backend compiles the graph path 1 compiled, so inductor's FX graph
    cache serves it when both run."""
    jobs = {"tp": (_compiled_tp, (name, False, False, 2)),
            "backend": (_compiled_by_backend, (name, "tpcompile", 2))}
    out = {}
    for key in paths:
        fn, args = jobs[key]
        try:
            out[key] = fn(*args)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[key] = {"error": traceback.format_exc()}
    return out


def backend_report(backend):
    from tpcompile.compile.backend import tpcompile_backend

    return (tpcompile_backend if backend == "tpcompile" else backend).report


def _graph_break(backend) -> dict:
    """A chain split by a graph break runs replicated and exact; the report says why."""
    import copy

    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    step = torch.compile(model, backend=backend)
    errs = {}
    for i in range(2):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i))
        out, ref = step(x), reference(x)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        errs[f"output_{i}"] = rel_err(out, ref)
    errs.update({n: rel_err(p.grad, r.grad) for (n, p), r in
                 zip(model.named_parameters(), reference.parameters())})
    return {"errs": errs, "shapes_kept": {n: tuple(p.shape) for n, p in model.named_parameters()} == full,
            "parallelized": tpcompile.parallelized(model) is not None,
            "report": [str(r) for r in backend_report(backend) if r.module == "Branchy"]}


def compiled(rank: int, world_size: int, names: list[str], dynamic: str | None) -> dict:
    """Every compile check for one world size; ``dynamic``: the model compiled with marked dims."""
    from torch.distributed.device_mesh import init_device_mesh

    # path 1 compiles the static graphs the backend compiles later with the same options
    # (OVERLAP_DEFAULT is off), so the backend's come from inductor's FX graph cache
    jobs = {f"tp_{n}": (_compiled_tp, n, False, False) for n in names}
    if dynamic:
        jobs["tp_dynamic"] = (_compiled_tp, dynamic, True, True)
    # the first model through a configured backend object, the others through the registered
    # name (as the graph-break case is)
    configured = tpcompile.backend(mesh=init_device_mesh("cpu", (world_size,)))
    jobs.update({f"backend_{n}": (_compiled_by_backend, n, configured if n == names[0] else "tpcompile")
                 for n in names})
    jobs["graph_break"] = (_graph_break, "tpcompile")
    out = {}
    for key, (fn, *args) in jobs.items():
        try:
            out[key] = fn(*args)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[key] = {"error": traceback.format_exc()}
    return out
