"""Greedy decoding side by side at 2 gloo ranks: tpcompile vs DTensor vs the unsharded model.

    python -m bench.generation [--world-size 2] [--new 32] [--repeats 3] [--runs 5]
    python -m bench.generation --checkpoint [--world-size 2] [--dir DIR] [--model 1b|mid]

``--checkpoint`` runs bench/generation_checkpoint.py instead: a Llama-3.2-1B-shaped
checkpoint saved to ``DIR``, then ``tpcompile.from_pretrained`` and ``generate`` on the ranks
(load, first-token and per-token times, peak memory per rank); ``--model mid``: a mid-size
Llama instead (hidden 1024, 8 layers).

A random Hugging Face Llama (hidden 512, 4 layers, 8 query / 4 kv heads, vocabulary 4096),
batch 1, a 16-token prompt. Rows:

- ``unsharded``: ``model.generate`` on rank 0 alone (the others wait), transformers' default
  dynamic cache.
- ``dtensor``: ``parallelize_module`` with transformers' own Llama TP styles (q/k/v/gate/up
  ``ColwiseParallel``, o/down ``RowwiseParallel``, local outputs: HF's attention infers heads
  with ``-1``), then ``model.generate`` on every rank: what ``tp_plan="auto"`` builds, without
  its checkpoint loading (``tp_plan`` needs ``from_pretrained`` and a saved model).
- ``tpcompile``: ``tpcompile.parallelize(model, (ids,))`` then ``tp.generate`` (a static cache
  sharded on kv heads, captured once; the timed runs reuse it).
- ``tpcompile compiled``: the same module after ``tp.compile_generation(options=
  tpcompile.compile_options())``: each decode step is ``torch.compile``d (inductor); the first
  generate compiles, the timed ones reuse it.

Per generated token: wall time of a whole ``generate`` (prefill included) / new tokens, best of
``--repeats`` rounds in which the paths take turns (the unsharded one on rank 0 alone). KV-cache bytes per rank after the run; collectives per decode step counted by
a dispatch mode (DTensor) and in the decode graph (tpcompile). ``--runs`` launches the whole
side-by-side run that many times (fresh processes) and reports, per tpcompile row, the median
and range of the speed-up over DTensor (DTensor ms per token / tpcompile ms per token). Prints
markdown tables.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpcompile.tools.launch import run_on_ranks

CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)


def _interleaved(generates: dict, repeats: int) -> dict:
    """Best seconds of each ``generate`` over ``repeats`` rounds, the paths taking turns in each
    round (load that comes and goes on a shared machine hits every path alike). A barrier
    after each call, outside the timing, starts every rank's next path together."""
    import torch.distributed as dist

    times = {name: [] for name in generates}
    for _ in range(repeats):
        for name, fn in generates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            dist.barrier()
    return {name: min(t) for name, t in times.items()}


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values))


class _Collectives(TorchDispatchMode):
    """Counts functional collectives issued (DTensor's redistributes call them on local tensors;
    ``CommDebugMode``'s module tracker fails inside ``generate``)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and "wait" not in func.name():
            self.count += 1
        return func(*args, **(kwargs or {}))


def _dtensor(model, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    plan = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(copy.deepcopy(model), mesh, plan)


def _rank_main(rank: int, world_size: int, new: int, repeats: int) -> dict:
    import torch.distributed as dist
    import transformers as tf

    import tpcompile
    from tpcompile.runtime.collectives import count_collectives

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).eval()
    ids = torch.randint(1, CONFIG["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1))
    args = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    rows = {}
    with torch.no_grad():
        if rank == 0:
            want = model.generate(ids, **args, return_dict_in_generate=True)
            rows["unsharded"] = {"cache": _cache_bytes(want.past_key_values), "collectives": 0,
                                 "tokens": want.sequences.tolist()}
        dist.barrier()
        dt = _dtensor(model, world_size)
        out = dt.generate(ids, **args, return_dict_in_generate=True)
        counts = []
        for n in (2, 4):
            with _Collectives() as comm:
                dt.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
            counts.append(comm.count)
        rows["dtensor"] = {"cache": _cache_bytes(out.past_key_values),
                           "collectives": (counts[1] - counts[0]) / 2, "tokens": out.sequences.tolist()}
        tp, compiled = tpcompile.parallelize(model, (ids,)), tpcompile.parallelize(model, (ids,))
        compiled.compile_generation(options=tpcompile.compile_options())
        for name, module in (("tpcompile", tp), ("tpcompile compiled", compiled)):
            module.generate(ids, **args)  # captures the decode step (and compiles it)
            tokens = module.generate(ids, **args)
            inner = next(iter(module.generation_modules.values()))
            rows[name] = {
                "cache": sum(b.numel() * b.element_size() for n, b in inner.named_buffers()
                             if "_cache_" in n),
                "collectives": sum(count_collectives(inner.signatures[-1][1])["forward"].values()),
                "tokens": tokens.tolist()}
        generates = {"unsharded": (lambda: model.generate(ids, **args)) if rank == 0 else (lambda: None),
                     "dtensor": lambda: dt.generate(ids, **args),
                     "tpcompile": lambda: tp.generate(ids, **args),
                     "tpcompile compiled": lambda: compiled.generate(ids, **args)}
        for name, seconds in _interleaved(generates, repeats).items():
            if name in rows:
                rows[name]["s"] = seconds / new
    return rows


PATHS = ("unsharded", "dtensor", "tpcompile", "tpcompile compiled")


def _table(results: list) -> None:
    r0 = results[0]
    want = r0["unsharded"]["tokens"]
    print("| path | ms / token | tokens / s | KV-cache bytes per rank | collectives per decode step | tokens = unsharded |")
    print("|---|---|---|---|---|---|")
    for name in PATHS:
        row = r0[name]
        same = all(r[name]["tokens"] == want for r in results if name in r)
        print(f"| {name} | {row['s'] * 1e3:.2f} | {1 / row['s']:.1f} | {row['cache']:,} | "
              f"{row['collectives']:g} | {'yes' if same else 'NO'} |")


def _speedups(runs: list) -> None:
    """Per tpcompile row: DTensor ms / tpcompile ms over the runs, median and range."""
    print(f"\nspeed-up per token over DTensor (DTensor ms / tpcompile ms), {len(runs)} runs:\n")
    print("| path | median | min - max | per run |")
    print("|---|---|---|---|")
    for name in PATHS[2:]:
        ratios = [r[0]["dtensor"]["s"] / r[0][name]["s"] for r in runs]
        print(f"| {name} | {statistics.median(ratios):.2f}x | {min(ratios):.2f} - "
              f"{max(ratios):.2f}x | {', '.join(f'{x:.2f}' for x in ratios)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--checkpoint", action="store_true",
                        help="the Llama-3.2-1B-shaped checkpoint run (generation_checkpoint.py)")
    parser.add_argument("--dir", default="/tmp/tpcompile-llama-1b")
    parser.add_argument("--model", choices=("1b", "mid"), default="1b",
                        help="--checkpoint's model: Llama-3.2-1B-shaped or mid-size")
    a = parser.parse_args()
    if a.checkpoint:
        from bench import generation_checkpoint

        generation_checkpoint.main(a.world_size, a.dir, a.model)
        return
    print(f"greedy decoding, {a.world_size} gloo ranks (CPU), Llama {CONFIG}, batch 1, prompt 16, "
          f"{a.new} new tokens, best of {a.repeats}, {a.runs} run(s)")
    runs = []
    for i in range(a.runs):
        runs.append(run_on_ranks(f"{__file__}:_rank_main", a.world_size, a.new, a.repeats))
        print(f"\nrun {i + 1}:\n", flush=True)
        _table(runs[-1])
    _speedups(runs)


if __name__ == "__main__":
    main()
