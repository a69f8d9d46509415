"""Small built-in models: the demo's default and the test suite's shared fixtures.

They are written the way people write models (plain ``nn.Module`` code, shape constants taken
from ``x.shape`` and config ints) so that tpcompile is exercised on ordinary code, not on code
written for it. Each factory takes keyword overrides so tests can build tiny or odd-sized
variants (indivisible widths, few KV heads, explicit attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPStack", "GPT2", "Llama", "ModelConfig", "build", "example_inputs", "MODELS"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    hidden: int = 128
    max_seq: int = 64
    sdpa: bool = True  # False: explicit softmax(q @ k^T) @ v attention
    fused_qkv: bool = False
    tie_embeddings: bool = False
    bias: bool = True
    dropout: float = 0.0  # GPT-2 only: attention probabilities, MLP hidden, residuals


class MLPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.hidden, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.hidden, cfg.dim, bias=cfg.bias)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """Residual Linear -> GELU -> Linear blocks on float inputs of shape (batch, seq, dim)."""

    def __init__(self, cfg: ModelConfig = ModelConfig()):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(MLPBlock(cfg) for _ in range(cfg.n_layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class CausalSelfAttention(nn.Module):
    """GPT-2 attention: one fused qkv projection, MHA, causal SDPA or explicit softmax."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.sdpa, self.p = cfg.n_heads, cfg.sdpa, cfg.dropout
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.attn_drop, self.resid_drop = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.max_seq, cfg.max_seq, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.max_seq, cfg.max_seq), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        if self.sdpa:
            p = self.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.c_fc = nn.Linear(cfg.dim, cfg.hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.hidden, cfg.dim, bias=cfg.bias)
        self.hidden_drop, self.resid_drop = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = self.hidden_drop(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x + self.resid_drop(self.c_proj(h))


class GPT2(nn.Module):
    """GPT-2 style LM: learned positions, LayerNorm, fused qkv, GELU MLP, tied embeddings."""

    def __init__(self, cfg: ModelConfig = ModelConfig(n_kv_heads=8, tie_embeddings=True)):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.dim)
        self.blocks = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """Llama attention: separate q/k/v, RoPE, grouped-query heads repeated with expand."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim, self.sdpa = cfg.dim // cfg.n_heads, cfg.sdpa
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = self.n_heads // self.n_kv_heads
        k = k[:, :, None].expand(B, self.n_kv_heads, n_rep, T, self.head_dim)
        k = k.reshape(B, self.n_heads, T, self.head_dim)
        v = v[:, :, None].expand(B, self.n_kv_heads, n_rep, T, self.head_dim)
        v = v.reshape(B, self.n_heads, T, self.head_dim)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
            att = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + mask
            y = att.softmax(dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama style LM: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied output head."""

    def __init__(self, cfg: ModelConfig = ModelConfig()):
        super().__init__()
        self.cfg = cfg
        head_dim = cfg.dim // cfg.n_heads
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(cfg.max_seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


MODELS = {
    "mlp": (MLPStack, ModelConfig()),
    "gpt2": (GPT2, ModelConfig(n_kv_heads=8, tie_embeddings=True)),
    "llama": (Llama, ModelConfig(bias=False)),
}


def build(name: str, seed: int = 0, **overrides) -> nn.Module:
    """Build built-in model ``name`` ('mlp', 'gpt2' or 'llama') with deterministic weights."""
    if name not in MODELS:
        raise ValueError(f"unknown built-in model {name!r}; choose from {sorted(MODELS)}")
    cls, cfg = MODELS[name]
    torch.manual_seed(seed)
    return cls(replace(cfg, **overrides))


def example_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> tuple:
    """Inputs shaped like a real call of a built-in model."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    if isinstance(model, MLPStack):
        return (torch.randn(batch, seq, cfg.dim, generator=g),)
    return (torch.randint(0, cfg.vocab, (batch, seq), generator=g),)
