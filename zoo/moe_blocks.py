"""Single transformers MoE blocks (Qwen3-MoE's sparse block: router, top-k, grouped-matmul
experts) at the shapes the expert-parallelism bench measures and ``advise`` is asked about.

``moe_block(experts, width, top_k, model_width)`` builds one block; ``SHAPES`` names the
published models' expert shapes. ``qwen3_30b_a3b``, ``mixtral_8x7b`` and ``deepseek_v3`` are
factories for ``tpcompile advise zoo/moe_blocks.py:NAME`` (built on the meta device there):
one block with its model's width, expert count, expert width and top-k, and one sequence of
4096 tokens. A DeepSeek-V3-shaped block has its 256 routed experts only (its shared expert,
a dense MLP beside them, is not among the experts cut).
"""

from __future__ import annotations

import torch

__all__ = ["SHAPES", "moe_block", "qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3"]

# name -> (experts, expert width, top-k, model width), from each model's published config
SHAPES = {
    "qwen3_30b_a3b": (128, 768, 8, 2048),
    "mixtral_8x7b": (8, 14336, 2, 4096),
    "deepseek_v3": (256, 2048, 8, 7168),
}
TOKENS = 4096


def moe_block(experts: int, width: int, top_k: int, model_width: int):
    """One Qwen3-MoE sparse block of these shapes (transformers' default init; under
    ``torch.device("meta")`` nothing is allocated)."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(hidden_size=model_width, moe_intermediate_size=width,
                               num_experts=experts, num_experts_per_tok=top_k)
    # a model sets it from_pretrained / __init__ (transformers' default); a bare block needs it
    config._experts_implementation = "grouped_mm"
    return tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)


def _published(name: str):
    """(block, (one sequence of ``TOKENS`` hidden states,)) of a published model's shape."""
    experts, width, top_k, model_width = SHAPES[name]
    block = moe_block(experts, width, top_k, model_width).to(torch.bfloat16)
    return block, (torch.zeros(1, TOKENS, model_width, dtype=torch.bfloat16),)


def qwen3_30b_a3b():
    return _published("qwen3_30b_a3b")


def mixtral_8x7b():
    return _published("mixtral_8x7b")


def deepseek_v3():
    return _published("deepseek_v3")
