"""The Hugging Face sweep's families and their tiny configs (bench/hf_sweep.py).

Families: every ``*ForCausalLM`` class ``transformers`` exports, plus the other classes of its
``MODEL_FOR_CAUSAL_LM_MAPPING`` (``GPT2LMHeadModel``, ``OpenAIGPTLMHeadModel``, ...). Each is
built from its own config class shrunk to hidden 64, 2 layers, 4 heads (GQA families 2 KV
heads, MQA ones 1), intermediate 128, vocab 256, 64..128 positions, dropout 0, MoE 4 experts
top-2, MLA's low ranks a quarter of hidden or less (q 16, kv 8: the shape of DeepSeek-V3's
1536 and 512 of 7168) (``tiny_config``), random init under ``torch.manual_seed(0)``, float32,
``train()``.
"""

from __future__ import annotations

BATCH, SEQ, VOCAB = 2, 16, 256
HIDDEN, LAYERS, HEADS, INTER, POSITIONS = 64, 2, 4, 128, 128


def first_line(e: BaseException | str) -> str:
    """An error's first line (a subprocess's stderr: its last line), for a row."""
    if isinstance(e, str):
        return e.strip().splitlines()[-1][:300] if e.strip() else ""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"



def families() -> dict[str, str]:
    """Class name -> how it was found."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {n: "*ForCausalLM" for n in dir(transformers)
           if n.endswith("ForCausalLM") and not n.startswith(("Auto", "TF", "Flax"))}
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        for n in (name if isinstance(name, (list, tuple)) else [name]):
            if n not in out and hasattr(transformers, n):
                out[n] = "MODEL_FOR_CAUSAL_LM_MAPPING"
    return dict(sorted(out.items()))


def _tiny_values(defaults: dict) -> dict:
    """The fields to override, given the config class's defaults (only keys it has)."""
    heads = HEADS
    v = {
        "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN,
        "embed_dim": HIDDEN, "n_embed": HIDDEN, "model_dim": HIDDEN, "hidden_dim": HIDDEN,
        "num_hidden_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS, "num_layers": LAYERS,
        "decoder_layers": LAYERS, "encoder_layers": LAYERS,
        "num_attention_heads": heads, "n_head": heads, "n_heads": heads, "num_heads": heads,
        "decoder_attention_heads": heads, "encoder_attention_heads": heads,
        "intermediate_size": INTER, "n_inner": INTER, "ffn_dim": INTER, "d_ff": INTER,
        "ffn_hidden_size": INTER, "decoder_ffn_dim": INTER, "encoder_ffn_dim": INTER,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "expert_intermediate_size": 64,
        "vocab_size": VOCAB, "max_position_embeddings": POSITIONS, "n_positions": POSITIONS,
        "n_ctx": POSITIONS, "max_sequence_length": POSITIONS, "seq_length": POSITIONS,
        "head_dim": HIDDEN // heads, "kv_channels": HIDDEN // heads,
        "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
        "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
        "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1,
        "kv_lora_rank": 8, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "qk_head_dim": 24, "rotary_dim": 8,
        "router_jitter_noise": 0.0, "use_cache": False, "tie_word_embeddings": None,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
        "sliding_window": None if defaults.get("sliding_window") is None else 32,
        "attention_window": None if defaults.get("attention_window") is None else 32,
    }
    v.pop("tie_word_embeddings")
    kv = defaults.get("num_key_value_heads", defaults.get("num_kv_heads"))
    if kv is not None or "num_key_value_heads" in defaults:
        # an MQA family by default stays MQA; GQA gets 2 KV heads (= ranks: sharded)
        mqa = kv == 1
        v["num_key_value_heads"] = v["num_kv_heads"] = 1 if mqa else 2
    if "multi_query" in defaults or "new_decoder_architecture" in defaults:
        pass  # kept as the family's default (Falcon: MQA, GPTBigCode: MQA)
    out = {k: val for k, val in v.items() if k in defaults}
    for k, val in defaults.items():  # dropout off everywhere
        if isinstance(val, float) and not isinstance(val, bool) and (
                "dropout" in k or "pdrop" in k or k.endswith("_drop") or "drop_rate" in k
                or k == "layerdrop" or k.endswith("_layerdrop")):
            out[k] = 0.0
    if isinstance(defaults.get("layer_types"), list):
        lt = defaults["layer_types"]
        kinds = list(dict.fromkeys(lt))  # keep both kinds of a hybrid family in 2 layers
        out["layer_types"] = (kinds + lt)[:LAYERS] if len(kinds) > 1 else lt[:LAYERS]
    for k in ("attention_layers", "attn_layer_indices", "block_types", "layers_block_type",
              "mlp_only_layers", "moe_layers", "attention_types"):
        if isinstance(defaults.get(k), list) and k != "attention_types":
            out[k] = [x for x in defaults[k] if not isinstance(x, int) or x < LAYERS][:LAYERS] \
                if all(isinstance(x, int) for x in defaults[k]) else defaults[k][:LAYERS]
    if "rope_scaling" in defaults and isinstance(defaults["rope_scaling"], dict):
        pass
    if "kv_lora_rank" in defaults and "head_dim" in defaults:
        out["head_dim"] = out.get("qk_rope_head_dim", 8)  # MLA: head_dim is the rope part
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = HEADS  # MLA: every head has its own K and V
    if "num_experts_per_token" in defaults:
        out["num_experts_per_token"] = 2
    if "num_key_value_heads" in out and "n_head_kv" in defaults:
        out["n_head_kv"] = out["num_key_value_heads"]
    return out


def tiny_config(cls):
    """(config, overridden fields) for ``cls``: its config class at the tiny sizes."""
    cfg_cls = cls.config_class
    defaults = cfg_cls().to_dict()
    for k in getattr(cfg_cls, "attribute_map", {}) or {}:
        defaults.setdefault(k, None)
    values = _tiny_values(defaults)
    if defaults.get("sub_configs") or getattr(cfg_cls, "sub_configs", None):
        text = getattr(cfg_cls, "sub_configs", {}).get("text_config")
        if text is not None:
            tdefaults = text().to_dict()
            values["text_config"] = _tiny_values(tdefaults)
    cfg = cfg_cls(**values)
    cfg._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    return cfg, values


def build(name: str, mode: str = "train"):
    import torch
    import transformers

    cls = getattr(transformers, name)
    cfg, _ = tiny_config(cls)
    torch.manual_seed(0)
    model = cls(cfg).float()
    model.train(mode == "train")
    return model


def example_ids():
    import torch

    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def get(cfg, key):
    """A config field, or None (per-layer fields of heterogeneous configs raise on access)."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # noqa: BLE001
        return None

