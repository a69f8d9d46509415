"""MLP idioms: SwiGLU on raw Parameters, fused gate / up weights or weights cast at use, ReLU², normalized hidden
features, a GroupNorm over channels, mixtures of experts (a ModuleList loop, stacked weights, torchtitan's loop over stacked
experts, Llama 4's scaled tokens),
and Gemma's per-layer inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.idioms.skeleton import Block, D, HIDDEN, LAYERS, LM, RMSNorm, SwiGLU, VOCAB


class RawParamSwiGLU(nn.Module):
    """(in, out) Parameters used with @ and einsum, no nn.Linear (JAX ports, minGPT forks)."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(D, hidden) / math.sqrt(D))
        self.w_up = nn.Parameter(torch.randn(D, hidden) / math.sqrt(D))
        self.w_down = nn.Parameter(torch.randn(hidden, D) / math.sqrt(hidden))

    def forward(self, x):
        gate = F.silu(x @ self.w_gate)
        up = torch.einsum("btd,dh->bth", x, self.w_up)
        return (gate * up) @ self.w_down


class ReluSquaredMLP(nn.Module):
    """Primer / NanoChat / Nemotron-H / Persimmon: ``w2(square(relu(w1 x)))``. ``torch.square``
    has no entry in the rule table: torch tags it pointwise, which is rule enough."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, hidden, bias=False), nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        return self.w2(torch.square(F.relu(self.w1(x))))


class NormalizedSwiGLU(SwiGLU):
    """A SwiGLU whose hidden activation is unit-normalised over its features before the down
    projection (``F.normalize(h, dim=-1)``, nGPT-style), scaled per feature: the norm spans
    the hidden features the ranks split, so its sum of squares is a per-token statistic."""

    def __init__(self, hidden: int = HIDDEN, linear=nn.Linear):
        super().__init__(hidden, linear)
        self.gain = nn.Parameter(torch.full((hidden,), math.sqrt(hidden)))

    def forward(self, x):
        return self.w2(F.normalize(F.silu(self.w1(x)) * self.w3(x), dim=-1) * self.gain)


class GroupNormMLP(nn.Module):
    """A UNet / audio-style MLP over channels: ``w2(silu(GroupNorm(w1 x)))`` with the hidden
    channels first (``(B, C, T)``), normalised in groups of 16 channels. Each rank holds whole
    groups: its statistics are its own, nothing is reduced."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, hidden), nn.Linear(hidden, D)
        self.norm = nn.GroupNorm(hidden // 16, hidden)

    def forward(self, x):
        h = self.norm(self.w1(x).transpose(1, 2))
        return self.w2(F.silu(h).transpose(1, 2))


class FusedGateUp(nn.Module):
    """Phi-3 / vLLM: one gate_up Linear(D, 2 * hidden), chunked in two."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.gate_up_proj = nn.Linear(D, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class InterleavedGateUp(FusedGateUp):
    """gpt-oss: one gate_up projection whose gate and up features alternate, taken apart by
    strided slices ``h[..., ::2]`` and ``h[..., 1::2]``."""

    def forward(self, x):
        h = self.gate_up_proj(x)
        return self.down_proj(F.silu(h[..., ::2]) * h[..., 1::2])


class ModuleListMoE(nn.Module):
    """Mixtral: softmax router, top-2, a loop over experts gathering their tokens by index."""

    def __init__(self, n_experts: int = 4, top_k: int = 2, hidden: int = 64):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(D, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden) for _ in range(n_experts))

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs = F.softmax(self.router(flat), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            y = expert(flat.index_select(0, token)) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view(B, T, C)


class FcMLP(nn.Module):
    """litgpt's ``LLaMAMLP``: ``proj(silu(fc_1(x)) * fc_2(x))``."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(D, hidden, bias=False), nn.Linear(D, hidden, bias=False)
        self.proj = nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class IndexPutMoE(nn.Module):
    """litgpt's ``LLaMAMoE`` (its Mixtral): top-k of the router's logits softmaxed, one
    boolean mask per expert from comparing the choices with ``arange``, and a loop whose
    indexed write accumulates: ``y[token_idx] += probs[...] * expert(x[token_idx])``
    (once exported: a gather ``y[token_idx]``, an in-place ``add_`` and an ``index_put_``
    writing the rows back)."""

    def __init__(self, n_experts: int = 4, top_k: int = 2, hidden: int = 64):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = nn.Linear(D, n_experts, bias=False)
        self.experts = nn.ModuleList(FcMLP(hidden) for _ in range(n_experts))

    def forward(self, x):
        B, T, C = x.size()
        x = x.view(-1, C)
        probs, indices = torch.topk(self.gate(x), self.top_k)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        masks = (indices.unsqueeze(-1) == torch.arange(self.n_experts, device=x.device))
        y = torch.zeros_like(x)
        for mask, expert in zip(masks.permute(2, 0, 1), self.experts):
            token_idx, expert_idx = torch.where(mask)
            y[token_idx] += probs[token_idx, expert_idx, None] * expert(x[token_idx])
        return y.view(B, T, C)


class StackedMoE(nn.Module):
    """Stacked (experts, out, in) weights applied to every token by bmm, gated densely
    (GShard / dense-dispatch style): no data-dependent shapes."""

    def __init__(self, n_experts: int = 4, top_k: int = 2, hidden: int = 64):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(D, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, D) / math.sqrt(D))
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, D) / math.sqrt(D))
        self.w2 = nn.Parameter(torch.randn(n_experts, D, hidden) / math.sqrt(hidden))

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        weights, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        gates = torch.zeros_like(flat[:, : self.n_experts]).scatter(-1, chosen, weights)
        xs = flat.unsqueeze(0).expand(self.n_experts, -1, -1)  # (experts, tokens, D)
        h = F.silu(torch.bmm(xs, self.w1.transpose(1, 2))) * torch.bmm(xs, self.w3.transpose(1, 2))
        y = torch.bmm(h, self.w2.transpose(1, 2))  # (experts, tokens, D)
        return (gates.t().unsqueeze(-1) * y).sum(0).view(B, T, C)


class GroupedExpertsLoop(StackedMoE):
    """torchtitan's ``GroupedExperts`` without grouped_mm (``_run_experts_for_loop``): tokens
    sorted by expert (``argsort``), counted by ``histc`` on the int64 picks (zoo/histc.py
    gives CPU its kernel), split by those counts, and each expert's ``w1[e]`` / ``w3[e]`` /
    ``w2[e]`` picked from the stacked weights inside the loop, padded by ``vstack`` with
    ``new_zeros``, put back in token order into ``zeros``, summed over each token's picks (the
    tokens were scaled by their scores before the experts, torchtitan's default) and added to
    a shared expert's output."""

    def __init__(self):
        from zoo.histc import install

        install()
        super().__init__()
        self.shared = SwiGLU(hidden=64)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        scores, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        counts = torch.histc(chosen.view(-1), bins=self.n_experts, min=0, max=self.n_experts)
        order = torch.argsort(chosen.view(-1), stable=True)
        routed = flat[order // self.top_k] * scores.view(-1)[order].reshape(-1, 1)
        outs = []
        sizes = counts.tolist()
        for e, xe in enumerate(torch.split(routed, sizes, dim=0)):
            h = F.silu(torch.matmul(xe, self.w1[e].transpose(-2, -1)))
            h = h * torch.matmul(xe, self.w3[e].transpose(-2, -1))
            outs.append(torch.matmul(h, self.w2[e].transpose(-2, -1)))
        out = torch.cat(outs, dim=0)
        out = torch.vstack((out, out.new_zeros((routed.shape[0] - sum(sizes), C))))
        unsorted = torch.zeros(B * T * self.top_k, C, dtype=x.dtype)
        unsorted[order] = out
        out = unsorted.reshape(-1, self.top_k, C).sum(dim=1)
        return (self.shared(flat) + out).reshape(B, T, C)


class EinsumMoE(StackedMoE):
    """StackedMoE's weights applied by ``einsum``, the tokens broadcast over the experts
    (``"td,ehd->eth"``: the activation has no expert dim), combined by a contraction over
    the experts (``"te,etd->td"``)."""

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        weights, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        gates = torch.zeros_like(flat[:, : self.n_experts]).scatter(-1, chosen, weights)
        h = F.silu(torch.einsum("td,ehd->eth", flat, self.w1)) * torch.einsum("td,ehd->eth", flat, self.w3)
        y = torch.einsum("eth,edh->etd", h, self.w2)
        return torch.einsum("te,etd->td", gates, y).view(B, T, C)


class ScaledTokensMoE(nn.Module):
    """Llama 4: every token repeated per expert and scaled by its sigmoid routing score before
    stacked ``(experts, in, out)`` experts (one fused gate_up, bmm), plus a shared expert that
    reads the unscaled tokens."""

    def __init__(self, n_experts: int = 4, top_k: int = 1, hidden: int = 64):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(D, n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(n_experts, D, 2 * hidden) / math.sqrt(D))
        self.down = nn.Parameter(torch.randn(n_experts, hidden, D) / math.sqrt(hidden))
        self.shared = SwiGLU(hidden)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        logits = self.router(flat)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter(1, chosen, top)
        scores = torch.sigmoid(scores.transpose(0, 1))  # (experts, tokens)
        routed = (flat.repeat(self.n_experts, 1) * scores.reshape(-1, 1)).view(self.n_experts, -1, C)
        gate, up = torch.bmm(routed, self.gate_up).chunk(2, dim=-1)
        y = torch.bmm(up * F.silu(gate), self.down)
        return (self.shared(flat) + y.sum(0)).view(B, T, C)


PER_LAYER = 32


class PerLayerInputBlock(Block):
    """A block that ends by gating a projection of its stream with its own per-layer input."""

    def __init__(self, attn, mlp):
        super().__init__(attn, mlp)
        self.gate = nn.Linear(D, PER_LAYER, bias=False)
        self.project = nn.Linear(PER_LAYER, D, bias=False)

    def forward(self, x, per_layer_input):
        x = super().forward(x)
        return x + self.project(F.gelu(self.gate(x)) * per_layer_input)


class PerLayerInputLM(LM):
    """Gemma 3n / Gemma 4 per-layer inputs: one (B, T, layers, P) tensor made before the blocks
    (its own embedding plus a normalised projection of the token embeddings), block i reading
    ``inputs[:, :, i, :]``."""

    def __init__(self):
        super().__init__(block=PerLayerInputBlock)
        self.embed_per_layer = nn.Embedding(VOCAB, LAYERS * PER_LAYER)
        self.per_layer_proj = nn.Linear(D, LAYERS * PER_LAYER, bias=False)
        self.per_layer_norm = RMSNorm(PER_LAYER)

    def forward(self, tokens):
        B, T = tokens.shape
        x = self.embed(tokens)
        made = self.per_layer_norm(self.per_layer_proj(x).view(B, T, LAYERS, PER_LAYER))
        inputs = (made + self.embed_per_layer(tokens).view(B, T, LAYERS, PER_LAYER)) * 2 ** -0.5
        for i, layer in enumerate(self.layers):
            x = layer(x, inputs[:, :, i, :])
        return self.head(self.norm(x))


class CastWeightsSwiGLU(SwiGLU):
    """Weights cast where they are used, the MLP computed in another precision than they are
    stored in: torchtitan's ``GroupedExperts`` (``w1.bfloat16()``), Hugging Face's MoE router
    (``F.linear(x.float(), self.weight.float())``). Here float64, so that a cut sums exactly
    what the whole model sums."""

    def forward(self, x):
        x64 = x.double()
        gate = F.silu(F.linear(x64, self.w1.weight.double()))
        up = F.linear(x64, self.w3.weight.to(torch.float64))
        return F.linear(gate * up, self.w2.weight.double()).type_as(x)
