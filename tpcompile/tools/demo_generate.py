"""``tpcompile demo --generate``: greedy generation on local gloo ranks against the unsharded model.

Builds a tiny random Llama (transformers' ``LlamaForCausalLM``: hidden 64, 2 layers, 4 query
and 2 kv heads, vocabulary 256), parallelizes it, and prints the tokens ``tp.generate`` returns
for a left-padded batch beside ``model.generate``'s, the KV-cache bytes per rank, and the
collectives of a decode step (see docs/generation.md).
"""

from __future__ import annotations

import time

import torch

from tpcompile.tools.launch import run_on_ranks

__all__ = ["run_generate_demo"]


def _rank_main(rank: int, world_size: int, new_tokens: int) -> dict:
    import transformers as tf

    from tpcompile.api import parallelize
    from tpcompile.runtime.collectives import count_collectives

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt is left-padded
    tp = parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
    args = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    got = tp.generate(ids, **args)
    want = model.generate(ids, **args)
    inner = next(iter(tp.generation_modules.values()))
    decode = inner.signatures[-1][1] if inner.signatures else inner.graph_module
    caches = {n: b for n, b in inner.named_buffers() if "_cache_" in n}
    cache = sum(b.numel() * b.element_size() for b in caches.values())
    full = sum(torch.Size(inner.plan.by_fqn[n].global_shape).numel() * b.element_size()
               for n, b in caches.items())
    return {"tokens": got[:, 6:].tolist(), "want": want[:, 6:].tolist(), "cache": cache,
            "full_cache": full, "decode": count_collectives(decode)["forward"]}


def run_generate_demo(world_size: int = 2, new_tokens: int = 8) -> int:
    start = time.perf_counter()
    print(f"tpcompile demo --generate: tiny Llama on {world_size} gloo ranks (CPU), "
          f"greedy, {new_tokens} new tokens, a left-padded batch of 2")
    results = run_on_ranks("tpcompile.tools.demo_generate:_rank_main", world_size, new_tokens)
    r0 = results[0]
    for row, (got, want) in enumerate(zip(r0["tokens"], r0["want"])):
        print(f"  prompt {row}: tpcompile {got}\n            unsharded {want}")
    kinds = ", ".join(f"{n} x {k}" for k, n in sorted(r0["decode"].items())) or "none"
    print(f"collectives per decode step: {kinds}")
    print(f"KV-cache bytes per rank: {r0['cache']:,} of {r0['full_cache']:,}")
    ok = all(r["tokens"] == r["want"] == r0["tokens"] for r in results)
    print(f"tokens {'identical to' if ok else 'DIFFER from'} the unsharded model's on every rank"
          f" -> {'OK' if ok else 'MISMATCH'}; demo took {time.perf_counter() - start:.1f}s")
    return 0 if ok else 1
