"""Rank-side bodies of tests/gloo/test_generation.py: decoders that own a static KV cache.

Each case parallelizes :class:`zoo.cache_models.CachedDecoder`, runs a prefill and greedy decode
steps on the ranks and on the unsharded model, and reports the tokens, the cache each rank
holds, the collectives each call signature's graph issues, and how bad calls are refused.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.runtime.collectives import count_collectives
from zoo.cache_models import CachedDecoder, greedy
from zoo.hf_models import hf_causal_lm, hf_prompt
from zoo.lit_cache_models import LitCachedDecoder

PROMPT, NEW = 5, 6


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _case(rank: int, world_size: int, kv_heads: int, seq_major: bool, plain_mask: bool) -> dict:
    torch.manual_seed(0)
    model = CachedDecoder(kv_heads=kv_heads, seq_major=seq_major, plain_mask=plain_mask)
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tp = tpcompile.parallelize(model, (prompt, torch.arange(PROMPT)))
    want = greedy(model, prompt, NEW)
    got = greedy(tp, prompt, NEW)
    caches = {n: tuple(b.shape) for n, b in tp.named_buffers() if "cache" in n}
    written = sum(float(b.abs().sum()) for n, b in tp.named_buffers() if "cache" in n)
    tp.reset_caches()
    after_reset = sum(float(b.abs().sum()) for n, b in tp.named_buffers() if "cache" in n)
    again = greedy(tp, prompt, NEW)  # after a reset: the same tokens again
    longer = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    lengths = [greedy(tp, longer[:, :t], n).tolist() == greedy(model, longer[:, :t], n).tolist()
               for t, n in ((3, 4), (9, 3))]  # other prompt lengths: the same two captures
    graphs = [tp.graph_module] + [gm for _, gm in tp.signatures]
    return {
        "tokens": got.tolist(), "want": want.tolist(), "again": again.tolist(), "lengths": lengths,
        "caches": caches, "full_cache": tuple(model.blocks[0].attn.kv_cache.k_cache.shape),
        "written": written, "after_reset": after_reset,
        "collectives": [count_collectives(gm)["forward"] for gm in graphs],
        "shared": all(gm.get_parameter("blocks.0.w1.weight") is tp.get_parameter("blocks.0.w1.weight")
                      and gm.get_buffer("blocks.0.attn.kv_cache.k_cache")
                      is tp.get_buffer("blocks.0.attn.kv_cache.k_cache") for gm in graphs),
        "beyond_cache": _error(lambda: tp(prompt[:, :1], torch.tensor([40]))),
        "batch_too_large": _error(lambda: tp(torch.zeros(3, 1, dtype=torch.long),
                                             torch.tensor([7]))),
        "after_errors": tp(prompt[:, :1], torch.tensor([PROMPT])).shape[-1],  # no hang, no desync
    }


def _lit_case() -> dict:
    """litgpt's layout (zoo/lit_cache_models.py): tokens, the cache each rank holds, and the
    collectives of the prefill and the decode graph."""
    torch.manual_seed(0)
    model = LitCachedDecoder()
    model.set_kv_cache(2)
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tp = tpcompile.parallelize(model, (prompt, torch.arange(PROMPT)))
    with torch.inference_mode():  # as litgpt's generate runs
        want, got = greedy(model, prompt, NEW), greedy(tp, prompt, NEW)
    graphs = [tp.graph_module] + [gm for _, gm in tp.signatures]
    return {"tokens": got.tolist(), "want": want.tolist(),
            "caches": {n: tuple(b.shape) for n, b in tp.named_buffers() if "kv_cache" in n},
            "full_cache": tuple(model.blocks[0].attn.kv_cache.k.shape),
            "collectives": [count_collectives(gm)["forward"] for gm in graphs]}


def litgpt_decode(rank: int, world_size: int) -> dict:
    """litgpt's own ``GPT`` (bench/upstream_models.py's tiny Llama 3) with its KV cache on
    (``set_kv_cache``): greedy tokens of the prefill and one-token steps, as litgpt's
    ``batched_next_token`` calls the model, next to the unsharded model's."""
    from bench.upstream_models import build

    model = build("litgpt.llama3")[0].eval()
    model.set_kv_cache(batch_size=2, max_seq_length=32)
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tp = tpcompile.parallelize(model, (prompt, torch.arange(PROMPT)))
    with torch.inference_mode():
        want, got = greedy(model, prompt, NEW), greedy(tp, prompt, NEW)
    graphs = [tp.graph_module] + [gm for _, gm in tp.signatures]
    return {"tokens": got.tolist(), "want": want.tolist(),
            "collectives": [count_collectives(gm)["forward"] for gm in graphs]}


def static_cache(rank: int, world_size: int, cases: list, lit: bool = False) -> dict:
    """Each gpt-fast case of ``cases``; with ``lit``, the litgpt-style decoder too."""
    out = {tuple(c): _case(rank, world_size, *c) for c in cases}
    if lit:
        out["litgpt-style"] = _lit_case()
    return out


# ----------------------------------------------------------------- Hugging Face generate

def _generated(model, tp, ids, mask, sample: bool) -> dict:
    """The unsharded model's and the module's greedy tokens; with ``sample``, their sampled
    tokens too (top-k, top-p, temperature), the module's ranks seeded apart."""
    greedy_args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    sample_args = dict(attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=20,
                       top_p=0.9, temperature=0.8, pad_token_id=0)
    out = {"want": model.generate(ids, **greedy_args).tolist(),
           "tokens": tp.generate(ids, **greedy_args).tolist()}
    if sample:
        torch.manual_seed(7)
        out["sample_want"] = model.generate(ids, **sample_args).tolist()
        torch.manual_seed(7 + dist.get_rank())  # ranks seeded apart: still the same tokens
        out["sampled"] = tp.generate(ids, **sample_args).tolist()
    return out


def _hf_case(name: str, sample: bool = True) -> dict:
    """Greedy tokens, the cache and the collectives; with ``sample``, sampled tokens and a
    refused beam search too."""
    model = hf_causal_lm(name).eval()
    ids, mask = hf_prompt()
    tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
    out = _generated(model, tp, ids, mask, sample)
    if sample:
        out["beams"] = _error(lambda: tp.generate(ids, num_beams=2, max_new_tokens=2))
    inner = next(iter(tp.generation_modules.values()))
    out["caches"] = {n: tuple(b.shape) for n, b in inner.named_buffers() if n.startswith("key_cache")}
    out["cache_bytes"] = sum(b.numel() * b.element_size() for n, b in inner.named_buffers()
                             if n.startswith(("key_cache", "value_cache")))
    out["rank"] = dist.get_rank()
    graphs = [inner.graph_module] + [gm for _, gm in inner.signatures]
    out["collectives"] = [count_collectives(gm)["forward"] for gm in graphs]
    # positions whose logits each graph computes (the LM head's rows)
    out["logit_rows"] = [gm.graph.output_node().args[0][0].meta["val"].shape[1] for gm in graphs]
    out["shared"] = all(p is tp.get_parameter(n.removeprefix("model."))
                        for n, p in inner.named_parameters())
    return out


def hf_generate(rank: int, world_size: int, names: list, train: bool = False,
                sample: bool = True) -> dict:
    out = {name: _hf_case(name, sample) for name in names}
    if train:
        out["train"] = train_then_generate(rank, world_size)
    return out


def vocab_generate(rank: int, world_size: int, names: list) -> dict:
    """``vocab_parallel=True``: greedy and sampled tokens (ranks seeded apart), the LM head's
    rows on this rank and each generation graph's collectives."""
    out = {}
    for name in names:
        model = hf_causal_lm(name).eval()
        ids, mask = hf_prompt()
        tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask},
                                   vocab_parallel=True)
        case = _generated(model, tp, ids, mask, sample=True)
        inner = next(iter(tp.generation_modules.values()))
        head = model.get_output_embeddings().weight
        case["head_rows"] = (inner.get_parameter("model." + next(
            n for n, p in model.named_parameters() if p is head)).shape[0], head.shape[0])
        case["collectives"] = [count_collectives(gm)["forward"] for gm in
                               [inner.graph_module] + [gm for _, gm in inner.signatures]]
        out[name] = case
    return out


def deep_generate(rank: int, world_size: int) -> dict:
    """A 6-layer Llama's greedy tokens against the unsharded model's, with the notes of its
    generation captures (a capture of the whole model notes why its blocks were not reused)."""
    model = hf_causal_lm("llama", layers=6).eval()
    ids, mask = hf_prompt()
    tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
    args = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    tokens = tp.generate(ids, **args).tolist()
    inner = next(iter(tp.generation_modules.values()))
    return {"equal": tokens == model.generate(ids, **args).tolist(),
            "notes": [n for n in inner.plan.notes if "captured whole" in n],
            "collectives": [count_collectives(gm)["forward"]
                            for gm in [inner.graph_module] + [g for _, g in inner.signatures]]}


# (prompt, new tokens): the first five fit the 64-position cache bucket, the sixth needs the
# 128 one, the last is back in the first
LENGTHS = [(2, 5), (6, 3), (7, 9), (9, 2), (1, 4), (60, 40), (5, 4)]


def prompt_lengths(rank: int, world_size: int, name: str) -> list:
    """Greedy ``generate`` at each of :data:`LENGTHS` (left-padded) next to the unsharded
    model's, counting captures (``SignatureCapture`` calls) and reading the module store."""
    import tpcompile.api as api

    captures, original = [], api.SignatureCapture.__call__

    def counted(self, *args, **kwargs):
        captures.append(args[0][0].shape)
        return original(self, *args, **kwargs)

    model = hf_causal_lm(name, positions=256).eval()
    ids = torch.randint(1, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    tp = tpcompile.parallelize(model, (ids[:, :6],),
                               example_kwargs={"attention_mask": torch.ones_like(ids[:, :6])})
    api.SignatureCapture.__call__ = counted
    out = []
    try:
        for length, new in LENGTHS:
            mask = torch.ones(2, length, dtype=torch.long)
            mask[1, :length // 2] = 0  # left padding
            args = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
            tokens = tp.generate(ids[:, :length], **args).tolist()
            out.append({"equal": tokens == model.generate(ids[:, :length], **args).tolist(),
                        "captures": len(captures), "buckets": [k[1] for k in tp.generation_modules],
                        "cache_held": [not any(b.is_meta for b in m.buffers())
                                       for m in tp.generation_modules.values()]})
    finally:
        api.SignatureCapture.__call__ = original
    return out


def _stderr_of(fn) -> str:
    """What ``fn()`` wrote to this process's stderr (file descriptor 2: loggers and warnings)."""
    with tempfile.TemporaryFile(mode="w+") as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return f.read()


def _quiet(fn) -> str:
    """What ``fn()`` wrote to stderr, then the Python warnings it raised: every one, even one
    shown before in this process (which the default filter would not print again)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = _stderr_of(fn)
    return text + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)


def decode_calls(rank: int, world_size: int) -> dict:
    """Per check mode: tokens, and how many of a 4-token ``generate``'s model calls go through
    a module (``TPModule.forward``: its checks) rather than straight to the decode graph; and
    the error for a pad token outside the vocabulary."""
    from tpcompile.runtime.module import TPModule

    model = hf_causal_lm("llama").eval()
    ids, mask = hf_prompt()
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want, calls, original = model.generate(ids, **args).tolist(), [], TPModule.forward

    def counted(self, *a, **k):
        calls.append(1)
        return original(self, *a, **k)

    out, tps = {}, {}
    for mode in ("new", "every"):
        tp = tps[mode] = tpcompile.parallelize(model, (ids,), check_calls=mode,
                                               example_kwargs={"attention_mask": mask})
        # captures the prefill and the decode step, then a new prompt length: no export notes
        out[f"{mode} stderr"] = _quiet(lambda: (tp.generate(ids, **args), tp.generate(
            ids[:, 1:], **dict(args, attention_mask=mask[:, 1:]))))
        TPModule.forward, calls[:] = counted, []
        try:
            tokens = tp.generate(ids, **args).tolist()
        finally:
            TPModule.forward = original
        out[mode] = {"equal": tokens == want, "module_calls": len(calls)}
    out["bad_pad"] = _error(lambda: tps["new"].generate(ids, attention_mask=mask, max_new_tokens=3,
                                                        eos_token_id=5, pad_token_id=999))
    return out


def train_then_generate(rank: int, world_size: int) -> dict:
    """Train the module and the unsharded model alike for 3 steps, then generate greedily."""
    model = hf_causal_lm("llama")
    ids, mask = hf_prompt()
    tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    before = tp.generate(ids, **args).tolist()
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    losses = []
    for module in (model, tp):
        module.train()
        opt = torch.optim.SGD(module.parameters(), lr=2.0)
        for _ in range(3):
            logits = module(batch, attention_mask=torch.ones_like(batch)).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256),
                                                     batch[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss))
        module.eval()
    return {"before": before, "want": model.generate(ids, **args).tolist(),
            "tokens": tp.generate(ids, **args).tolist(),
            "loss_err": abs(losses[0] - losses[1]) / abs(losses[0])}


def compiled_decode(rank: int, world_size: int) -> dict:
    """Greedy tokens of the eager module, then of ``torch.compile`` of it (inductor)."""
    import tpcompile as tc

    torch.manual_seed(0)
    model = CachedDecoder()
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tp = tc.parallelize(model, (prompt, torch.arange(PROMPT)))
    eager = greedy(tp, prompt, NEW)  # captures the prefill and decode signatures
    tp.reset_caches()
    compiled = greedy(torch.compile(tp, options=tc.compile_options()), prompt, NEW)
    return {"eager": eager.tolist(), "compiled": compiled.tolist(),
            "want": greedy(model, prompt, NEW).tolist()}


def hf_compiled_generate(rank: int, world_size: int) -> dict:
    """Greedy ``tp.generate`` eagerly, then with its decode steps compiled (inductor)."""
    model = hf_causal_lm("llama").eval()
    ids, mask = hf_prompt()
    tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    eager = tp.generate(ids, **args).tolist()
    tp.compile_generation(options=tpcompile.compile_options())
    compiled = tp.generate(ids, **args).tolist()
    inner = next(iter(tp.generation_modules.values()))
    return {"eager": eager, "compiled": compiled, "want": model.generate(ids, **args).tolist(),
            "used": "compiled_decode" in inner.__dict__}


def _calls_outside_graphs(fn) -> int:
    """Python function calls ``fn()`` makes, not counting those inside a captured graph's
    forward (the model's own work: its generated code, one line per node)."""
    count, inside = [0], []

    def profile(frame, event, arg):
        if event == "call" and not inside:
            if frame.f_code.co_filename.startswith("<eval_with_key>"):
                inside.append(frame)
            else:
                count[0] += 1
        elif event == "return" and inside and frame is inside[0]:
            inside.pop()

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def python_calls(rank: int, world_size: int) -> dict:
    """Per layer count (2 and 4): the Python calls of a warm greedy ``generate`` of 2 and of 6
    new tokens outside the model's graphs, and the lengths it returned."""
    out = {}
    for layers in (2, 4):
        model = hf_causal_lm("llama", layers=layers).eval()
        ids, mask = hf_prompt()
        tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
        for new in (2, 6):
            args = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
            tp.generate(ids, **args)  # captures; the ranks agree on its calls
            lengths = []
            calls = _calls_outside_graphs(lambda: lengths.append(tp.generate(ids, **args).shape[1]))
            out[(layers, new)] = {"calls": calls, "length": lengths[0] - ids.shape[1]}
    return out
