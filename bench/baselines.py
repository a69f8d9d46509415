"""The PyTorch baseline: ``parallelize_module`` with hand-written torchtitan-style plans.

torchtitan shards Llama's ``wq``/``wk``/``wv``/``w1``/``w3`` with ``ColwiseParallel`` and
``wo``/``w2`` with ``RowwiseParallel``; the same styles are used here for GPT-2 (``c_attn``,
``c_fc`` / ``attn.c_proj``, ``c_proj``) and the MLP (``fc1`` / ``fc2``). Embeddings, norms and
LM heads stay replicated, as in tpcompile's plan, so both sides run the same collectives.

``ColwiseParallel`` hands each rank a *local* tensor (``use_local_output=True``), so a model
that views its projections with global head counts breaks. torchtitan's Llama infers them
(``view(bs, seqlen, -1, head_dim)``); :func:`prepare` swaps the built-in attention classes for
variants that do the same and are otherwise the same code (same math, same shapes):

* Llama: heads and KV heads read from the projections' local sizes (``-1``).
* GPT-2: the fused ``c_attn`` output is split in local thirds, which is right only if each
  rank's contiguous block of rows holds its own q, k and v heads; :func:`prepare` reorders the
  rows rank-major (Megatron's interleaved qkv layout) before sharding. The model's function is
  unchanged, only the storage order of ``c_attn``'s rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tpcompile.tools import models

__all__ = ["prepare", "plan_for", "parallelize_dtensor"]


class InferredHeadsLlamaAttention(models.LlamaAttention):
    """``LlamaAttention`` with head counts read from the (possibly local) projections."""

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = q * cos + models.rotate_half(q) * sin
        k = k * cos + models.rotate_half(k) * sin
        n_kv, n_rep = k.shape[1], q.shape[1] // k.shape[1]
        k = k[:, :, None].expand(B, n_kv, n_rep, T, self.head_dim).reshape(B, -1, T, self.head_dim)
        v = v[:, :, None].expand(B, n_kv, n_rep, T, self.head_dim).reshape(B, -1, T, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class InferredHeadsGPT2Attention(models.CausalSelfAttention):
    """``CausalSelfAttention`` splitting the (possibly local) fused qkv output in thirds."""

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.c_attn(x)
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=2)
        hd = x.shape[-1] // self.n_heads
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


def _rank_major_qkv(linear: nn.Linear, world_size: int) -> None:
    """Reorder fused [q; k; v] rows to [q_0; k_0; v_0; q_1; ...] (contiguous per rank)."""
    dim = linear.out_features // 3
    per = dim // world_size
    order = torch.cat([torch.arange(part * dim + r * per, part * dim + (r + 1) * per)
                       for r in range(world_size) for part in range(3)])
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def prepare(model: nn.Module, world_size: int) -> nn.Module:
    """Make a built-in model DTensor-ready in place (see the module docstring); returns it."""
    for module in model.modules():
        if type(module) is models.LlamaAttention:
            module.__class__ = InferredHeadsLlamaAttention
        elif type(module) is models.CausalSelfAttention:
            if not module.sdpa:
                raise ValueError("the DTensor baseline covers SDPA attention only")
            module.__class__ = InferredHeadsGPT2Attention
            _rank_major_qkv(module.c_attn, world_size)
    return model


# built-in model -> (its list of blocks, [(submodule in a block, style)])
_STYLES = {
    models.Llama: ("layers", [("attention.wq", ColwiseParallel), ("attention.wk", ColwiseParallel),
                              ("attention.wv", ColwiseParallel), ("attention.wo", RowwiseParallel),
                              ("feed_forward.w1", ColwiseParallel),
                              ("feed_forward.w3", ColwiseParallel),
                              ("feed_forward.w2", RowwiseParallel)]),
    models.GPT2: ("blocks", [("attn.c_attn", ColwiseParallel), ("attn.c_proj", RowwiseParallel),
                             ("c_fc", ColwiseParallel), ("c_proj", RowwiseParallel)]),
    models.MLPStack: ("blocks", [("fc1", ColwiseParallel), ("fc2", RowwiseParallel)]),
}


def plan_for(model: nn.Module) -> dict:
    """torchtitan-style ``parallelize_module`` plan for a built-in model."""
    for cls, (blocks, styles) in _STYLES.items():
        if isinstance(model, cls):
            return {f"{blocks}.{i}.{name}": style()
                    for i in range(len(getattr(model, blocks))) for name, style in styles}
    raise ValueError(f"no baseline plan for {type(model).__name__}")


def parallelize_dtensor(model: nn.Module, mesh) -> nn.Module:
    """``parallelize_module`` of a prepared built-in model over a 1-D mesh (in place)."""
    prepare(model, mesh.size())
    return parallelize_module(model, mesh, plan_for(model))
