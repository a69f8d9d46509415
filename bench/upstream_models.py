"""The upstream corpus's models (bench/upstream.py): each built from its library's own classes.

A case's builder returns ``(model, inputs, kwargs, shape)``: the model at the tiny sizes below
under ``torch.manual_seed(0)`` in train mode, its example inputs, and ``shape``, the fields
the model's sizes (heads, KV heads, layers, experts; ``hf_verdict.plan_row`` reads its
layers). Libraries are imported inside the builders: a missing one is that row's
``ImportError``, never the corpus's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 64, 2, 4, 2, 128, 256
BATCH, SEQ = 2, 16


@dataclass(frozen=True)
class Case:
    library: str
    builder: Callable[[], tuple]
    # the gradients' reference: the model ("model"), or its captured graph ("captured": a
    # model whose own backward does not run on CPU, flex attention's)
    reference: str = "model"
    tolerance: float | None = None  # None: hf_numerics.TOLERANCE


def _shape(heads=HEADS, kv_heads=KV_HEADS, experts=None) -> dict:
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": LAYERS, "num_experts": experts}


def _ids():
    import torch

    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _features(batch_first: bool, seq: int = SEQ):
    import torch

    shape = (BATCH, seq, HIDDEN) if batch_first else (seq, BATCH, HIDDEN)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------ PyTorch's own layers

def _encoder(batch_first: bool, norm_first: bool = False):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, INTER, dropout=0.0,
                                       batch_first=batch_first, norm_first=norm_first)
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    return model.train(), (_features(batch_first),), {}, _shape(kv_heads=HEADS)


def _decoder(batch_first: bool):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(HIDDEN, HEADS, INTER, dropout=0.0, batch_first=batch_first)
    model = nn.TransformerDecoder(layer, LAYERS)
    inputs = (_features(batch_first), _features(batch_first, SEQ // 2))
    return model.train(), inputs, {}, _shape(kv_heads=HEADS)


def _transformer(batch_first: bool):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Transformer(HIDDEN, HEADS, LAYERS, LAYERS, INTER, dropout=0.0,
                           batch_first=batch_first)
    inputs = (_features(batch_first, SEQ // 2), _features(batch_first))
    return model.train(), inputs, {}, _shape(kv_heads=HEADS)


def _attention_stack():
    """``nn.MultiheadAttention`` as blocks use it: residual self-attention, no weights out."""
    import torch
    from torch import nn

    class AttentionStack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
                                        for _ in range(LAYERS))

        def forward(self, x):
            for attn in self.layers:
                x = x + attn(x, x, x, need_weights=False)[0]
            return x

    torch.manual_seed(0)
    return AttentionStack().train(), (_features(True),), {}, _shape(kv_heads=HEADS)


# ------------------------------------------------------------------ torchtitan

def _titan(kind: str):
    import torch

    from zoo.histc import install

    install()  # torchtitan's MoE routers count tokens with an int64 histc (zoo/histc.py)

    if kind == "llama3":
        from torchtitan.models.llama3.model.args import TransformerModelArgs as Args
        from torchtitan.models.llama3.model.model import Transformer as Model
        args = Args(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                    vocab_size=VOCAB, multiple_of=32, max_seq_len=128)
    elif kind in ("qwen3", "qwen3_moe"):
        from torchtitan.models.moe import MoEArgs
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs as Args
        from torchtitan.models.qwen3.model.model import Qwen3Model as Model
        moe = dict(moe_enabled=True, moe_inter_dim=32, moe_args=MoEArgs(
            num_experts=4, num_shared_experts=0, top_k=2, use_grouped_mm=False,
            load_balance_coeff=None)) if kind == "qwen3_moe" else {}
        args = Args(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                    head_dim=HIDDEN // HEADS, hidden_dim=INTER, vocab_size=VOCAB, max_seq_len=128,
                    **moe)
    else:
        from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs as Args
        from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model as Model
        from torchtitan.models.moe import MoEArgs
        # the latent a quarter of hidden or less, as DeepSeek-V3's (512 of 7168) and the HF
        # sweep's MLA (kv 8); torchtitan 0.3's debug config has one wider than the model
        args = Args(vocab_size=VOCAB, dim=HIDDEN, inter_dim=INTER, moe_inter_dim=32,
                    n_layers=LAYERS, n_dense_layers=1, n_heads=HEADS, kv_lora_rank=8,
                    q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    max_seq_len=128, original_seq_len=128,
                    moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2,
                                     score_func="softmax", use_grouped_mm=False,
                                     load_balance_coeff=None))
        args.moe_impl = "standard"  # set by update_from_config from a JobConfig in 0.2.2
    torch.manual_seed(0)
    model = Model(args)
    with torch.no_grad():  # the trainer calls it under no_grad: it copies into leaves
        model.init_weights()
    kv = HEADS if kind == "deepseek_v3" else KV_HEADS
    return model.train(), (_ids(),), {}, _shape(kv_heads=kv, experts=4 if kind in (
        "deepseek_v3", "qwen3_moe") else None)


def _titan03(kind: str):
    """torchtitan 0.3's ``debugmodel`` of ``kind`` (flex attention only: a document BlockMask
    from its ``get_attention_masks``, zoo/flex_models.py), where 0.3 is installed."""
    from importlib.metadata import version

    if not version("torchtitan").startswith("0.3"):
        raise ImportError(f"needs torchtitan 0.3 (installed: {version('torchtitan')}): "
                          "pip install --no-deps -r .ci/torchtitan-0.3.txt")
    from zoo import flex_models

    model, inputs, kwargs = flex_models.torchtitan(kind)
    attention = model.layers["0"].attention
    experts = [m.num_experts for m in model.modules() if hasattr(m, "num_experts")]
    return model.train(), inputs, kwargs, _shape(
        attention.n_heads, getattr(attention, "n_kv_heads", attention.n_heads),
        experts[0] if experts else None) | {"num_hidden_layers": len(model.layers)}


def _hf_flex():
    """Hugging Face Llama under ``attn_implementation="flex_attention"`` (8 heads over 2 KV
    heads, 2 layers: zoo/flex_models.py), its block mask built in forward."""
    from zoo import flex_models

    model, inputs = flex_models.build("hf_llama_flex")
    return model.train(), inputs, {}, _shape(heads=8, kv_heads=2)


# ------------------------------------------------------------------ litgpt

def _litgpt(name: str, kv_heads: int = KV_HEADS, **extra):
    import torch
    from litgpt.config import Config
    from litgpt.model import GPT

    cfg = Config.from_name(name, n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS,
                           n_query_groups=kv_heads, head_size=HIDDEN // HEADS,
                           intermediate_size=INTER, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                           block_size=128, **extra)
    torch.manual_seed(0)
    return GPT(cfg).train(), (_ids(),), {}, _shape(kv_heads=kv_heads,
                                                    experts=extra.get("n_expert"))


# ------------------------------------------------------------------ torchtune

def _torchtune(kind: str):
    import torch

    if kind == "llama3":
        from torchtune.models.llama3 import llama3 as builder
    else:
        from torchtune.models.qwen2 import qwen2 as builder
    torch.manual_seed(0)
    model = builder(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                    embed_dim=HIDDEN, intermediate_dim=INTER, max_seq_len=128)
    return model.train(), (_ids(),), {}, _shape()


CASES: dict[str, Case] = {
    "torch.TransformerEncoder": Case("torch", lambda: _encoder(True)),
    "torch.TransformerEncoder (seq first)": Case("torch", lambda: _encoder(False)),
    "torch.TransformerEncoder (pre-LN)": Case("torch", lambda: _encoder(True, norm_first=True)),
    "torch.TransformerDecoder": Case("torch", lambda: _decoder(True)),
    "torch.Transformer": Case("torch", lambda: _transformer(True)),
    "torch.Transformer (seq first)": Case("torch", lambda: _transformer(False)),
    "torch.MultiheadAttention": Case("torch", _attention_stack),
    "torchtitan.llama3": Case("torchtitan", lambda: _titan("llama3")),
    "torchtitan.qwen3": Case("torchtitan", lambda: _titan("qwen3")),
    "torchtitan.qwen3_moe": Case("torchtitan", lambda: _titan("qwen3_moe")),
    "torchtitan.deepseek_v3": Case("torchtitan", lambda: _titan("deepseek_v3")),
    "torchtitan-0.3.llama3": Case("torchtitan 0.3", lambda: _titan03("llama3"), "captured"),
    "torchtitan-0.3.qwen3": Case("torchtitan 0.3", lambda: _titan03("qwen3"), "captured"),
    # its routed experts compute in bfloat16 (w1_EFD.bfloat16()): each rank rounds its partial
    # sum, the unsharded model the whole one, 4 bfloat16 units apart (tests/gloo/test_torchtitan_flex)
    "torchtitan-0.3.deepseek_v3": Case("torchtitan 0.3", lambda: _titan03("deepseek_v3"),
                                       "captured", 4 * 2.0 ** -8),
    "transformers.llama (flex attention)": Case("transformers", _hf_flex, "captured"),
    "litgpt.pythia": Case("litgpt", lambda: _litgpt("pythia-14m")),
    "litgpt.llama3": Case("litgpt", lambda: _litgpt("Llama-3.2-1B")),
    "litgpt.phi2": Case("litgpt", lambda: _litgpt("phi-2")),
    "litgpt.gemma2": Case("litgpt", lambda: _litgpt("Gemma-2-2b")),
    "litgpt.qwen2.5": Case("litgpt", lambda: _litgpt("Qwen2.5-0.5B")),
    "litgpt.qwen3": Case("litgpt", lambda: _litgpt("Qwen3-0.6B")),
    "litgpt.olmo": Case("litgpt", lambda: _litgpt("OLMo-1B-hf", kv_heads=HEADS)),
    "litgpt.falcon (MQA)": Case("litgpt", lambda: _litgpt("falcon-7b", kv_heads=1)),
    "litgpt.mixtral (MoE)": Case("litgpt", lambda: _litgpt(
        "Mixtral-8x7B-v0.1", n_expert=4, n_expert_per_token=2)),
    "torchtune.llama3": Case("torchtune", lambda: _torchtune("llama3")),
    "torchtune.qwen2": Case("torchtune", lambda: _torchtune("qwen2")),
}


def build(name: str):
    """``(model, inputs, kwargs, shape)`` of case ``name``."""
    return CASES[name].builder()
