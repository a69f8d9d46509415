"""Rank-side bodies of tests/gloo/test_from_pretrained.py: a ``save_pretrained`` directory to
tokens, through ``tpcompile.from_pretrained`` and through the recipe it wraps (meta build,
``parallelize``, ``load_full_state_dict``), with no buffer factory written by the caller."""

from __future__ import annotations

import torch

import tpcompile
from zoo.hf_models import hf_causal_lm, hf_prompt

GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)


def _report(tp, ids, mask) -> dict:
    """Greedy tokens, where every tensor lives, and the shapes of two sharded weights."""
    tokens = tp.generate(ids, attention_mask=mask, **GREEDY).tolist()
    tensors = list(tp.parameters()) + list(tp.buffers())
    inner = next(iter(tp.generation_modules.values()))  # the static-cache module generate ran
    return {
        "tokens": tokens,
        "devices": sorted({t.device.type for t in tensors + list(inner.buffers())}),
        "inv_freq": tp.get_buffer("model.rotary_emb.inv_freq").tolist(),
        "q_proj": tuple(tp.get_parameter("model.layers.0.self_attn.q_proj.weight").shape),
        "down_proj": tuple(tp.get_parameter("model.layers.1.mlp.down_proj.weight").shape),
        "lm_head_rows": tp.get_parameter("lm_head.weight").shape[0],
        "vocab": tp.skeleton_capture.skeleton.config.vocab_size,
    }


def _meta_recipe(directory: str, ids, mask):
    """The documented big-model recipe by hand: meta build, parallelize, load the directory."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(directory))
    tp = tpcompile.parallelize(model.eval(), (ids,), example_kwargs={"attention_mask": mask})
    tpcompile.load_full_state_dict(tp, directory)
    return tp


def save_unsharded(directory: str) -> tuple[list, list]:
    """Save the tiny Llama in ``directory`` (safetensors shards of at most 100 KB); return its
    own greedy tokens and RoPE table, which the ranks must reproduce from the directory."""
    model = hf_causal_lm("llama").eval()
    model.save_pretrained(directory, max_shard_size="100KB")
    ids, mask = hf_prompt()
    return (model.generate(ids, attention_mask=mask, **GREEDY).tolist(),
            model.get_buffer("model.rotary_emb.inv_freq").tolist())


def from_checkpoint(rank: int, world_size: int, directory: str, paths: list) -> dict:
    """Each of ``paths`` ("from_pretrained", "recipe") built from ``directory``: its report."""
    ids, mask = hf_prompt()
    build = {"from_pretrained": lambda: tpcompile.from_pretrained(directory),
             "recipe": lambda: _meta_recipe(directory, ids, mask)}
    return {path: _report(build[path](), ids, mask) for path in paths}
