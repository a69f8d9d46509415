"""``TPModule.generate``: Hugging Face ``model.generate`` on this rank's shards.

The module ``parallelize`` returned runs the graph captured for its example call (no KV cache:
Hugging Face models are captured with ``use_cache=False``). Generation runs a module captured
around a static KV cache instead (:mod:`tpcompile.runtime.static_cache`), one per batch size
and cache bucket, kept across calls (:mod:`tpcompile.runtime.cache_modules`): a new prompt
length within the bucket needs no capture.

The loop is ``GenerationMixin.generate``'s, reusing its pieces on the model's meta skeleton:
the generation config (``_prepare_generation_config``), the logits processors and warpers
(``_get_logits_processor``), position ids from the attention mask (left padding), EOS and pad
handling. Every rank computes the same replicated logits; the next tokens are chosen on the
group's first rank and broadcast, so ranks never diverge (sampling consumes that rank's RNG:
seed it as you would seed the unsharded model).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpcompile.errors import InputError, TPCompileError
from tpcompile.runtime.cache_modules import cache_length, cached_module

__all__ = ["generate"]


class _Steps:
    """The model calls of one ``generate``: a prefill, then one-token decode steps.

    The first decode step goes through the module: its input checks, the capture of the
    one-token signature, the ranks' agreement on the call. In the default check mode
    (``"new"``) later steps call that step's graph's ``forward`` directly: they have its
    shapes and dtypes, and every rank builds them identically (the tokens are broadcast from
    one rank; the mask and positions follow from the prefill's, which the module checked), so
    a check would only repeat the first step's verdict, while its Python (flattening,
    signature matching, the call's description; and torch.export's own input check, a
    forward pre-hook of the graph that flattens the inputs again with their paths) costs as
    much as a small model's step. The pad token a finished row
    feeds is checked once, against the embedding table. ``check_calls="every"`` checks every
    step, as asked.
    """

    def __init__(self, tp, module, mask: torch.Tensor, max_len: int, pad: int | None):
        batch, self.pos = mask.shape
        self.tp, self.module, self.pad, self.graph = tp, module, pad, None
        self.full = mask.new_zeros(batch, max_len)
        self.full[:, :self.pos] = mask
        self.positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        cache_position = torch.arange(self.pos, device=input_ids.device)
        return self.module(input_ids, self.full, self.positions, cache_position)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits after feeding ``tokens`` (batch,) at the next position."""
        self.full[:, self.pos] = 1
        self.positions = self.positions[:, -1:] + 1
        args = (tokens[:, None], self.full, self.positions,
                torch.tensor([self.pos], device=tokens.device))
        self.pos += 1
        if self.graph is not None:  # its forward: no export input check (see the class doc)
            return self.graph.forward(*args)
        logits = _decode_step(self.tp, self.module)(*args)
        if self.tp.generation_compile is None and self.module.call_check.mode == "new":
            spec, self.graph = self.module._graph_for(args, {})
            if self.pad is not None:
                spec.check((torch.full_like(args[0], self.pad),) + args[1:], {})
        return logits


def _decode_step(tp, module):
    """What a decode step calls: ``module``, or ``torch.compile`` of it (``tp.compile_generation``)
    once its one-token signature is captured."""
    if tp.generation_compile is None or not module.signatures:
        return module
    if "compiled_decode" not in module.__dict__:  # not a child module: no state_dict entries
        module.__dict__["compiled_decode"] = torch.compile(module, **tp.generation_compile)
    return module.__dict__["compiled_decode"]


def _settings(skeleton, input_ids: torch.Tensor, generation_config, kwargs: dict):
    """The generation config and the number of new tokens, refusing what is not supported."""
    config, unused = skeleton._prepare_generation_config(generation_config, **kwargs)
    if unused:
        raise InputError(f"generate() got arguments it does not use: {sorted(unused)}\n  hint: "
                         "pass input_ids, attention_mask and generation-config fields")
    if config.num_beams != 1 or config.num_return_sequences != 1:
        raise InputError("tpcompile's generate() decodes greedily or by sampling, one sequence "
                         f"per prompt; got num_beams={config.num_beams}, "
                         f"num_return_sequences={config.num_return_sequences}")
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be (batch, length), got {list(input_ids.shape)}")
    length = input_ids.shape[1]
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - length
    if new < 1:
        raise InputError(f"nothing to generate: max_new_tokens={new}")
    window = getattr(skeleton.config.get_text_config(), "sliding_window", None)
    if window and length + new > window:
        raise InputError(f"{length} prompt + {new} new tokens exceed the sliding window of "
                         f"{window}: tpcompile's static cache serves sliding-window layers only "
                         "up to the window")
    return config, new


def _bucket(skeleton, needed: int) -> int:
    """The cache length for ``needed`` positions, within the model's position limits."""
    text = skeleton.config.get_text_config()
    limits = [getattr(text, name, None) for name in ("sliding_window", "max_position_embeddings")]
    return cache_length(needed, min((x for x in limits if x), default=None))


@torch.no_grad()
def generate(tp, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             generation_config=None, **kwargs) -> torch.Tensor:
    """See :meth:`tpcompile.TPModule.generate`."""
    skeleton = getattr(tp.skeleton_capture, "skeleton", None)
    if skeleton is None or not callable(getattr(skeleton, "_get_logits_processor", None)):
        raise TPCompileError("generate() needs a Hugging Face causal LM (a GenerationMixin) "
                             "parallelized with tpcompile.parallelize")
    from transformers.generation.logits_process import LogitsProcessorList

    config, new = _settings(skeleton, input_ids, generation_config, kwargs)
    (batch, length), device = input_ids.shape, input_ids.device
    processors = skeleton._get_logits_processor(
        generation_config=config, input_ids_seq_length=length, encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(), device=device)
    eos = config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=device)
    pad = config.pad_token_id if config.pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    max_len = _bucket(skeleton, length + new)
    module = cached_module(tp, batch, max_len)
    module.reset_caches()
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    steps = _Steps(tp, module, mask, max_len, pad if len(eos) else None)
    logits = steps.prefill(input_ids)
    sequences, unfinished = input_ids, torch.ones(batch, dtype=torch.bool, device=device)
    source = dist.get_global_rank(tp.group, 0)
    for step in range(new):
        scores = processors(sequences, logits[:, -1].to(torch.float32))
        if config.do_sample:
            chosen = torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)
        else:
            chosen = scores.argmax(-1)
        dist.broadcast(chosen, src=source, group=tp.group)  # every rank feeds the same token
        if len(eos):
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
            unfinished &= ~torch.isin(chosen, eos)
        sequences = torch.cat([sequences, chosen[:, None]], dim=1)
        if step == new - 1 or not bool(unfinished.any()):
            break
        logits = steps.decode(chosen)
    return sequences
