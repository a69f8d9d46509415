"""A checkpoint directory to tokens on gloo ranks: what a real-size model costs at each stage.

    nice python -m bench.generation --checkpoint [--world-size 2] [--dir /tmp/tpcompile-llama-1b]
    nice python -m bench.generation --checkpoint --model mid --dir /tmp/tpcompile-llama-mid

A random Llama-3.2-1B-shaped Hugging Face model (:data:`LLAMA_1B`: hidden 2048, 16 layers,
32 query / 8 kv heads, intermediate 8192, vocabulary 128256, tied embeddings, Llama 3 RoPE
scaling; 1.24B parameters, float32, about 4.9 GB) is saved with ``save_pretrained``
(safetensors shards of at most 1 GB) by one process, which also runs the unsharded
``generate`` for the reference tokens and exits before the ranks start (two copies of the
model would not fit beside each other on a 24 GiB machine). The directory is reused when it
holds a run's ``reference.json``. Then each rank:

- ``tpcompile.from_pretrained(dir)``: ``parallelize`` time (on the meta model) and load time
  (``load_full_state_dict`` reading this rank's slices) apart;
- time to first token (``max_new_tokens=1``): a prompt's first call (it captures the
  static-cache module); then six new lengths in the same cache bucket, each's first call
  against one call of the same length right after (single calls both), counting the captures
  they start (0 expected); the median of the per-length ratios;
- per decode token: a whole ``generate`` of :data:`NEW` tokens minus one of 1, over ``NEW - 1``;
  and ``NEW - 1`` decode steps back to back, called through the module (its checks) and as
  its bare rewritten graph, per step; :data:`ROUNDS` rounds in which the four take turns, the
  ratio ``generate`` / bare graph taken per round and its median reported;
- peak RSS (``ru_maxrss``) against the bytes of the shards it holds (parameters, buffers);
- greedy tokens of two prompt lengths, compared with the unsharded model's.

``--model mid`` runs the same on :data:`LLAMA_MID` (hidden 1024, 8 layers, 16 / 8 heads,
vocabulary 32000). Times are the slowest rank's medians (ratios: the largest rank's median).
``run`` takes any Llama config: the CI test runs it on a tiny one
(tests/gloo/test_from_pretrained.py).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192))
# a mid-size Llama (0.18B parameters) for the same measurements in a few minutes: --model mid
LLAMA_MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)
MODELS = {"1b": (LLAMA_1B, "Llama-3.2-1B-shaped"), "mid": (LLAMA_MID, "mid-size Llama")}
FIRST, NEW_LENGTHS, NEW = 24, (40, 33, 17, 29, 45, 21), 16  # prompt lengths; all fit the 64 bucket
ROUNDS = 5  # decode rounds; each ratio is the median of its rounds


def _prompt(vocab: int, length: int):
    import torch

    return torch.randint(1, vocab, (1, 40), generator=torch.Generator().manual_seed(1))[:, :length]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reference(rank: int, world_size: int, directory: str, config: dict) -> dict:
    """Build, save and generate with the unsharded model (one process); its tokens."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    start = time.perf_counter()
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    model.save_pretrained(directory, max_shard_size="1GB")
    saved = time.perf_counter() - start
    tokens = {}
    with torch.no_grad():
        for length in (FIRST, NEW_LENGTHS[0]):
            ids = _prompt(config["vocab_size"], length)
            tokens[str(length)] = model.generate(ids, max_new_tokens=NEW, do_sample=False,
                                                 pad_token_id=0).tolist()
    out = {"tokens": tokens, "build_save_s": saved, "peak_rss": _peak_rss(),
           "params": sum(p.numel() for p in model.parameters())}
    (Path(directory) / "reference.json").write_text(json.dumps(out))
    return out


def _timed(fn, repeats: int = 1) -> tuple[float, object]:
    """Best wall time of ``repeats`` calls (a barrier before each), and the last result."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def _load(directory: str):
    """``from_pretrained``, with the load (``load_full_state_dict``) timed apart."""
    import tpcompile
    import tpcompile.state.pretrained as pretrained

    loading, original = [], pretrained.load_full_state_dict

    def timed_load(*args, **kwargs):
        start = time.perf_counter()
        original(*args, **kwargs)
        loading.append(time.perf_counter() - start)

    pretrained.load_full_state_dict = timed_load
    try:
        total, tp = _timed(lambda: tpcompile.from_pretrained(directory))
    finally:
        pretrained.load_full_state_dict = original
    return tp, {"parallelize_s": total - loading[0], "load_s": loading[0]}


def _first_tokens(tp, vocab: int) -> dict:
    """Times to first token: a prompt's first call (it captures), then per new length its
    first call and one call of the same length right after, counting the captures new lengths
    start. Both sides are single calls (a best-of-n repeat against a single first call would
    favour the repeat on a loaded machine); the ratio is per length, its median reported."""
    import tpcompile.api as api

    one = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    first, _ = _timed(lambda: tp.generate(_prompt(vocab, FIRST), **one))
    captures, original = [], api.SignatureCapture.__call__

    def counted(*args, **kwargs):
        captures.append(1)
        return original(*args, **kwargs)

    api.SignatureCapture.__call__ = counted
    new, again = [], []
    try:
        for n in NEW_LENGTHS:
            new.append(_timed(lambda: tp.generate(_prompt(vocab, n), **one))[0])
            again.append(_timed(lambda: tp.generate(_prompt(vocab, n), **one))[0])
    finally:
        api.SignatureCapture.__call__ = original
    ratios = [a / b for a, b in zip(new, again)]
    return {"ttft_first_s": first, "ttft_new_length_s": statistics.median(new),
            "ttft_repeated_s": statistics.median(again), "ttft_ratio": statistics.median(ratios),
            "ttft_ratios": ratios, "new_length_captures": len(captures)}


def _decode(tp, vocab: int, rounds: int = ROUNDS) -> dict:
    """Per-token cost of ``generate``'s decode steps, and of one step with and without the
    module around its graph, in ``rounds`` rounds in which they take turns (load that comes
    and goes on a shared machine hits all alike). Per round: ``generate``'s per-token time
    over the bare graph's per-step time of that round; the median of the rounds reported."""
    import torch

    ids = _prompt(vocab, FIRST)
    args = dict(do_sample=False, pad_token_id=0)
    tp.generate(ids, max_new_tokens=2, **args)  # captures the one-token signature
    inner = list(tp.generation_modules.values())[-1]
    full = torch.zeros(1, inner.graph_module.key_cache_0.shape[2], dtype=torch.long)
    full[:, :FIRST + 1] = 1
    step = (ids[:, :1], full, torch.tensor([[FIRST]]), torch.tensor([FIRST]))
    graph = inner.signatures[-1][1]
    calls = {"many": lambda: tp.generate(ids, max_new_tokens=NEW, **args),
             "one": lambda: tp.generate(ids, max_new_tokens=1, **args),
             # as many steps back to back as generate's decode loop runs
             "module": lambda: [inner(*step) for _ in range(NEW - 1)],
             "graph": lambda: [graph.forward(*step) for _ in range(NEW - 1)]}
    times = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in calls.items():
                times[name].append(_timed(fn)[0] / (NEW - 1))
    token = [m - o for m, o in zip(times["many"], times["one"])]
    ratios = [t / g for t, g in zip(token, times["graph"])]
    return {"decode_token_s": statistics.median(token),
            "step_module_s": statistics.median(times["module"]),
            "step_graph_s": statistics.median(times["graph"]),
            "decode_ratio": statistics.median(ratios), "decode_ratios": ratios}


def ranks(rank: int, world_size: int, directory: str) -> dict:
    """Everything one rank measures (see the module doc)."""
    tp, out = _load(directory)
    vocab = tp.skeleton_capture.skeleton.config.vocab_size
    out.update(_first_tokens(tp, vocab))
    out.update(_decode(tp, vocab))
    held = {id(t): t for t in list(tp.parameters()) + list(tp.buffers())}
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in held.values())
    out["tokens"] = {str(n): tp.generate(_prompt(vocab, n), max_new_tokens=NEW, do_sample=False,
                                         pad_token_id=0).tolist()
                     for n in (FIRST, NEW_LENGTHS[0])}
    out["peak_rss"] = _peak_rss()
    return out


def run(directory: str, config: dict, world_size: int = 2) -> dict:
    """The unsharded reference (unless ``directory`` holds one), then the ranks' measurements."""
    from tpcompile.tools.launch import run_on_ranks

    saved = Path(directory) / "reference.json"
    if saved.is_file():
        want = json.loads(saved.read_text())
    else:
        Path(directory).mkdir(parents=True, exist_ok=True)
        want = run_on_ranks(f"{__file__}:reference", 1, directory, config, timeout=3600)[0]
    per_rank = run_on_ranks(f"{__file__}:ranks", world_size, directory, timeout=3600)
    return {"reference": want, "ranks": per_rank}


def table(result: dict) -> str:
    """The measurements as markdown: times the slowest rank's, memory per rank."""
    ranks_, want = result["ranks"], result["reference"]
    t = {k: max(r[k] for r in ranks_) for k in ranks_[0] if k.endswith("_s")}
    gb, same = 1e9, all(r["tokens"] == want["tokens"] for r in ranks_)
    rows = [
        ("parameters", f"{want['params'] / 1e9:.3f} B"),
        ("parallelize (meta model)", f"{t['parallelize_s']:.1f} s"),
        ("load (this rank's slices)", f"{t['load_s']:.1f} s"),
        (f"first token, first call ({FIRST}-token prompt; captures)", f"{t['ttft_first_s']:.2f} s"),
        (f"first token, new lengths {list(NEW_LENGTHS)}: first call (median)",
         f"{t['ttft_new_length_s']:.3f} s"),
        ("first token, the same lengths again, one call each (median)",
         f"{t['ttft_repeated_s']:.3f} s"),
        ("new length / repeated, per length (median; target <= 1.2)",
         f"{max(r['ttft_ratio'] for r in ranks_):.2f}"),
        ("captures the new lengths started", str(max(r["new_length_captures"] for r in ranks_))),
        (f"decode, per token of generate ({NEW} new tokens; median of {ROUNDS} rounds)",
         f"{t['decode_token_s'] * 1e3:.1f} ms"),
        ("decode step through the module (its checks)", f"{t['step_module_s'] * 1e3:.1f} ms"),
        ("decode step, bare graph", f"{t['step_graph_s'] * 1e3:.1f} ms"),
        ("generate per token / bare graph, per round (median; target <= 1.3)",
         f"{max(r['decode_ratio'] for r in ranks_):.2f}"),
        ("unsharded reference process: peak RSS", f"{want['peak_rss'] / gb:.2f} GB")]
    for i, r in enumerate(ranks_):
        limit = 1.2 * r["shard_bytes"] + 0.5e9
        rows.append((f"rank {i}: shard bytes / peak RSS / target (1.2 x shards + 0.5 GB)",
                     f"{r['shard_bytes'] / gb:.2f} / {r['peak_rss'] / gb:.2f} / "
                     f"{limit / gb:.2f} GB"))
    rows.append((f"greedy tokens = unsharded ({FIRST}- and {NEW_LENGTHS[0]}-token prompts)",
                 "yes" if same else "NO"))
    return "| measure | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


def main(world_size: int = 2, directory: str = "/tmp/tpcompile-llama-1b",
         model: str = "1b") -> None:
    config, title = MODELS[model]
    print(f"{title} random checkpoint, {world_size} gloo ranks (CPU, 1 thread each), "
          f"{directory}\n{config}\n", flush=True)
    result = run(directory, config, world_size)
    print(table(result))
    untokened = [{k: v for k, v in r.items() if k != "tokens"}
                 for r in [result["reference"]] + result["ranks"]]
    print("\nraw (reference, then each rank):", json.dumps(untokened))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/tpcompile-llama-1b")
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    a = parser.parse_args()
    main(a.world_size, a.dir, a.model)
