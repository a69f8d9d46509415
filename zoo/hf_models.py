"""Tiny random-init Hugging Face transformers models (never downloaded), at the configs the
tests and benchmarks share.

``hf_model(name)`` and ``hf_inputs`` are the gloo numerics tests' models (tests/gloo/workers.py,
the support table, LoRA, bench/communication.py); ``hf_causal_lm(name)`` and ``hf_prompt`` the
generation tests' causal LMs (tests/gloo/generation_workers.py, pretrained_workers.py).
transformers is imported when a model is built, so importing this module needs no transformers.
"""

from __future__ import annotations

import torch

__all__ = ["MOE", "SEQ2SEQ", "hf_model", "moe_model", "hf_inputs", "hf_causal_lm", "hf_prompt"]

# the MoE causal LMs: name -> (config class, model class, config arguments); every one runs its
# experts through transformers' grouped matmul. Uneven: 5 experts over 2 or 4 ranks; fine-grained:
# 64 experts 16 wide, top-8 (DeepSeek / Qwen3-MoE's shape, scaled down)
_LM = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=2, max_position_embeddings=64)
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=5,
                       num_experts_per_tok=2, decoder_sparse_step=1, head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2, eos_token_id=0)),
    "qwen3_moe_64": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                     dict(intermediate_size=128, moe_intermediate_size=16, num_experts=64,
                          num_experts_per_tok=8, decoder_sparse_step=1, head_dim=8)),
}

# encoder-decoders: name -> (config class, model class, sizes); every other setting is the
# config's default, use_cache=True included (its stacks keep their own copies of the config),
# but Whisper's special token ids, which must fall inside the tiny vocabulary
_WIDTHS = dict(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=128,
               decoder_ffn_dim=128)
SEQ2SEQ = {
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=128, d_model=64, d_kv=8, d_ff=128, num_layers=2, num_heads=8)),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(_WIDTHS, max_position_embeddings=64)),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",  # 16 mel bins x 32 frames
                dict(_WIDTHS, num_mel_bins=16, max_source_positions=16, max_target_positions=64,
                     pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)),
}


def hf_model(name: str):
    """Tiny random-init transformers models (never downloaded)."""
    import transformers as tf

    torch.manual_seed(0)
    small = dict(max_position_embeddings=64)
    if name == "llama_deep":  # 4 identical layers: captured reusing blocks (core/stamp.py)
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, **small))
    if name == "gemma2_alternating":  # 8 layers, sliding (window 4) and full: period 2
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, head_dim=8, sliding_window=4,
            tie_word_embeddings=False, attn_implementation="eager", **small))
    if name.startswith("llama"):
        kv = {"llama": 2, "llama_mqa": 1, "llama_uneven": 2}[name]
        vocab, inter = (50257, 11008) if name == "llama_uneven" else (128, 128)
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=inter,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=kv,
                             **small)  # use_cache stays True: tpcompile captures without it
        return tf.LlamaForCausalLM(cfg)
    if name in MOE:  # experts stacked in 3-D parameters, run by a grouped matmul
        return moe_model(name)
    if name in SEQ2SEQ:
        config, model, sizes = SEQ2SEQ[name]
        return getattr(tf, model)(getattr(tf, config)(**sizes))
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=8, n_positions=64,
                            resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0,
                            eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                        intermediate_size=128, hidden_dropout_prob=0, attention_probs_dropout_prob=0,
                        **small)
    return tf.BertModel(cfg) if name == "bert_model" else tf.BertForMaskedLM(cfg)


def moe_model(name: str, **overrides):
    """A tiny random-init MoE causal LM of :data:`MOE` (``overrides``: config arguments)."""
    import transformers as tf

    torch.manual_seed(0)
    config, model, kwargs = MOE[name]
    return getattr(tf, model)(getattr(tf, config)(**{**_LM, **kwargs, **overrides}))


def hf_inputs(model) -> tuple[torch.Tensor, dict]:
    """Token ids (2 x 16) and an attention mask that pads the second sequence; an
    encoder-decoder also gets decoder token ids (2 x 8), and Whisper log-mel features (2 x 16
    bins x 32 frames) in place of the encoder's tokens."""
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    if not model.config.is_encoder_decoder:
        return ids, {"attention_mask": mask}
    decoder = {"decoder_input_ids": torch.randint(0, vocab, (2, 8), generator=gen)}
    if hasattr(model.config, "num_mel_bins"):
        return torch.randn(2, model.config.num_mel_bins, 32, generator=gen), decoder
    return ids, {"attention_mask": mask, **decoder}


def hf_causal_lm(name: str, positions: int = 64, layers: int = 2):
    """Tiny random-init causal LMs (hidden 64, ``layers`` layers, vocab 256), never downloaded;
    ``positions``: a Llama-like model's position limit."""
    import transformers as tf

    torch.manual_seed(0)
    llama_like = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=positions)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=layers,
                                                n_head=4, n_positions=64, resid_pdrop=0,
                                                embd_pdrop=0, attn_pdrop=0))
    # 8 query heads over 2 kv heads (GQA) or 1 (MQA): fewer kv heads than 4 ranks
    heads = {"llama_8q2kv": (8, 2), "llama_mqa": (8, 1)}
    if name in heads:
        llama_like.update(num_attention_heads=heads[name][0], num_key_value_heads=heads[name][1])
        name = "llama"
    if name == "llama_pkv":
        return _past_key_values_llama(tf)(tf.LlamaConfig(**llama_like))
    config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig,
              "qwen3": tf.Qwen3Config}[name](**llama_like)
    return {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
            "mistral": tf.MistralForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[name](config)


def _past_key_values_llama(tf):
    """A Llama whose forward names its cache ``past_key_values`` and ignores a ``cache``
    keyword, as transformers' did before 5.24 (then ``cache``)."""
    class PastKeyValuesLlama(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                    past_key_values=None, logits_to_keep=0, **kwargs):
            kwargs.pop("cache", None)  # an unknown keyword, which the old **kwargs ignored
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, cache=past_key_values,
                                   logits_to_keep=logits_to_keep, **kwargs)
    return PastKeyValuesLlama


def hf_prompt():
    """Token ids (2 x 6) and an attention mask that left-pads the second sequence."""
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    return ids, mask
