"""Block idioms: how a block puts its attention, its MLP and the residual stream together.

The skeleton's block is sequential (``x = x + attn(norm(x))``, then ``x + mlp(norm(x))``).
These blocks keep its attention and MLP and change only how their outputs meet the residual.
"""

from __future__ import annotations

from torch import nn

from zoo.idioms.skeleton import D


class ParallelResidualFirst(nn.Module):
    """Cohere (``CohereDecoderLayer``) and litgpt's ``parallel_residual`` with a shared norm:
    attention and the MLP read one normed input side by side, and their outputs are added to
    the residual in one expression with the residual FIRST,
    ``residual + attn(ln(x)) + mlp(ln(x))``: ``add(add(x, attn), mlp)`` once exported, so each
    row-parallel output meets a replicated value before the two meet each other."""

    def __init__(self, attn, mlp):
        super().__init__()
        self.norm = nn.LayerNorm(D, bias=False)  # Cohere's LayerNorm has no bias
        self.attn, self.mlp = attn(), mlp()

    def forward(self, x, *extra):
        residual = x
        h = self.norm(x)
        return residual + self.attn(h, *extra) + self.mlp(h)


class ParallelDroppedOut(nn.Module):
    """GPT-J (``GPTJBlock``), CodeGen, GPT-NeoX's ``use_parallel_residual`` and Phi: attention
    and the MLP read one normed input side by side, each output goes through its own dropout
    (the MLP's output bias added before it), then both are added to the residual:
    ``dropout(attn(h)) + dropout(mlp(h)) + x``. Their released configs drop nothing
    (``resid_pdrop=0.0``), and train-mode export keeps the op all the same."""

    def __init__(self, attn, mlp, p: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn, self.mlp = attn(), mlp()
        self.attn_drop, self.mlp_drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x, *extra):
        h = self.norm(x)
        return self.attn_drop(self.attn(h, *extra)) + self.mlp_drop(self.mlp(h)) + x
