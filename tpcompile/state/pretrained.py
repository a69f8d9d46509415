"""``tpcompile.from_pretrained``: a Hugging Face checkpoint directory to a tensor-parallel module.

The big-model recipe in one call, never holding the whole model on a rank: read the config,
build the causal LM on the meta device (no memory), ``parallelize`` it (planning needs shapes
only), then :func:`tpcompile.load_full_state_dict` reads only this rank's slices from the
``save_pretrained`` safetensors, and the non-persistent buffers (RoPE tables) are recomputed
from the config (:mod:`tpcompile.state.config_buffers`). The result has ``generate``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tpcompile.api import parallelize
from tpcompile.errors import TPCompileError
from tpcompile.runtime.module import TPModule
from tpcompile.state.full_state import load_full_state_dict

__all__ = ["from_pretrained"]


def _meta_causal_lm(path: Path):
    """The checkpoint's causal LM on the meta device, in its config's dtype, with its
    generation config (EOS and pad ids ``generate`` defaults to)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    except ImportError as e:
        raise TPCompileError("from_pretrained needs transformers: pip install transformers") from e
    config = AutoConfig.from_pretrained(path)
    saved = getattr(config, "architectures", None) or []
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=getattr(config, "dtype", None) or torch.float32)
    except ValueError as e:  # transformers: no causal LM class for this config
        raise _not_causal(path, saved or [type(config).__name__]) from e
    if saved and type(model).__name__ not in saved:  # a BertModel saved, BertLMHeadModel built
        raise _not_causal(path, saved)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _not_causal(path: Path, saved: list[str]) -> TPCompileError:
    return TPCompileError(
        f"{path} holds a {', '.join(saved)}, not a causal LM: from_pretrained builds the "
        "checkpoint's causal LM (AutoModelForCausalLM) for generate\n  hint: build the model "
        "on the meta device yourself, then tpcompile.parallelize(model, example_inputs) and "
        "tpcompile.load_full_state_dict(tp, path)")


def _example() -> tuple[tuple, dict]:
    """A call shaped like a real one: 2 sequences of 8 token ids (token 0) with their mask."""
    ids = torch.zeros(2, 8, dtype=torch.long)
    return (ids,), {"attention_mask": torch.ones_like(ids)}


def from_pretrained(path: str | os.PathLike, example_inputs=None, mesh=None, *,
                    device="cpu", strict: bool = True, **parallelize_options) -> TPModule:
    """A Hugging Face causal LM saved in ``path`` (``save_pretrained``: ``config.json`` and
    safetensors, one file or sharded), parallelized over ``mesh``; call on every rank.

    Args:
        path: a local checkpoint directory.
        example_inputs: the example call for :func:`tpcompile.parallelize` (then give
            ``example_kwargs`` too if calls pass an attention mask); None: 2 x 8 token ids
            with an ``attention_mask``. ``generate`` captures its own calls and needs none.
        mesh, parallelize_options: as for :func:`tpcompile.parallelize`, but
            ``vocab_parallel`` defaults to True: the embedding table and the LM head (a fifth
            of Llama-3.2-1B, tied) are cut by vocabulary like every other weight, for one more
            all-reduce and the all-gather of the logits (the last position's in ``generate``).
        device, strict: as for :func:`tpcompile.load_full_state_dict`.

    Returns:
        the :class:`TPModule`, holding only this rank's shards, read from the checkpoint
        slice by slice; ``tp.generate(...)`` as ``model.generate``.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise TPCompileError(f"no config.json in {path}\n  hint: pass a directory written by "
                             "save_pretrained (a local path; nothing is downloaded)")
    model = _meta_causal_lm(path)
    if example_inputs is None:
        example_inputs, kwargs = _example()
        parallelize_options.setdefault("example_kwargs", kwargs)
    parallelize_options.setdefault("vocab_parallel", True)
    tp = parallelize(model, example_inputs, mesh, **parallelize_options)
    load_full_state_dict(tp, path, strict=strict, device=device)
    return tp
