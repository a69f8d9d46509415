"""Decoding a Hugging Face Llama at world size 1: tpcompile's generate against Hugging Face's own.

    bash bench/gpu.sh hf-decode              # skips (exit 0) without a CUDA device or transformers
    bash bench/gpu.sh hf-decode --device cpu # the rehearsal: the same code at tiny sizes

One random ``transformers.LlamaForCausalLM`` (dim 2048, 8 layers, 16 query / 8 KV heads,
vocabulary 32000 by default: bench/gpu_decode.py's decoder shape and arguments), batch 1 by
default, greedy, four paths:

- ``hf eager``: ``model.generate`` with transformers' default dynamic cache;
- ``hf static compiled``: ``model.generate(cache_implementation="static")``, which on CUDA
  compiles the decode step itself (its ``CompileConfig``: ``mode="reduce-overhead"``, CUDA
  graphs): the path Hugging Face documents for fast decoding;
- ``tpcompile eager``: ``tpcompile.parallelize(model, (ids,))`` on a 1-rank group, then
  ``tp.generate`` (its static cache, captured once);
- ``tpcompile reduce-overhead``: the same after ``tp.compile_generation(options=...)`` with
  tpcompile's inductor options and ``list_mode_options("reduce-overhead")``.

Per token: (time of ``generate`` with ``--new`` tokens - time with 2) / (``--new`` - 2), so the
prefill and the first token fall out; each path is warmed up twice (compiles, graph records),
then timed ``--repeats`` times taking turns, best kept. Tokens are compared to ``hf eager``
(float32 by default so that greedy ties stay apart). Writes
bench/results/gpu-hf-decode-<device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
import torch.distributed as dist

from bench.gpu_decode import decoder_parser, hf_check, init_world


def parse(argv=None) -> argparse.Namespace:
    p = decoder_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.new < 3:
        p.error("--new must be at least 3 (per token: the time of --new tokens less that of 2)")
    return args


def _paths(model, ids, device: str) -> dict:
    """name -> (n new tokens -> generated ids)."""
    import tpcompile
    from torch._inductor import list_mode_options

    def hf(**extra):
        return lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=0, **extra)
    tp, compiled = tpcompile.parallelize(model, (ids,)), tpcompile.parallelize(model, (ids,))
    mode = list_mode_options("reduce-overhead") if device == "cuda" else {}
    compiled.compile_generation(options={**tpcompile.compile_options(), **mode})
    return {"hf eager": hf(),
            "hf static compiled": hf(cache_implementation="static"),
            "tpcompile eager": lambda n: tp.generate(ids, max_new_tokens=n, do_sample=False),
            "tpcompile reduce-overhead": lambda n: compiled.generate(ids, max_new_tokens=n,
                                                                     do_sample=False)}


def _seconds(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args) -> dict:
    import transformers as tf
    from torch._dynamo.utils import counters

    init_world(args.device)
    warnings.filterwarnings("ignore", message="tpcompile: input .* has size 1")  # batch 1: fixed
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim,
                            intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                            max_position_embeddings=args.prompt + args.new + 16)
    model = tf.LlamaForCausalLM(config).to(args.device, getattr(torch, args.dtype)).eval()
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to(args.device)
    rows = {}
    with torch.no_grad():
        paths = _paths(model, ids, args.device)
        for name, gen in paths.items():
            graphs = counters["stats"]["unique_graphs"]
            tokens = [gen(args.new).tolist() for _ in range(2)][-1]  # warm-up: compile, record
            rows[name] = {"tokens": tokens, "short": [], "long": [],
                          "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs}
        for _ in range(args.repeats):
            for name, gen in paths.items():
                rows[name]["short"].append(_seconds(lambda: gen(2), args.device))
                rows[name]["long"].append(_seconds(lambda: gen(args.new), args.device))
    want, ours = rows["hf eager"]["tokens"], rows["tpcompile eager"]["tokens"]
    out = {name: {"ms_per_token": 1e3 * (min(r["long"]) - min(r["short"])) / (args.new - 2),
                  "first_2_tokens_ms": 1e3 * min(r["short"]), "same_as_hf_eager": r["tokens"] == want,
                  "same_as_tpcompile_eager": r["tokens"] == ours,
                  "dynamo_graphs": r["dynamo_graphs"]} for name, r in rows.items()}
    dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": tf.__version__, "config": vars(args),
            "rows": out}


def report(result: dict) -> int:
    """Print the table; 1 when tpcompile's compiled tokens differ from its eager ones."""
    c, rows = result["config"], result["rows"]
    print(f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}: "
          f"HF Llama {c['layers']} layers, dim {c['dim']}, {c['heads']}/{c['kv_heads']} heads, "
          f"vocab {c['vocab']}, batch {c['batch']}, prompt {c['prompt']}, {c['new']} new tokens, {c['dtype']}, "
          f"world size 1\n")
    print("| path | ms / token (decode) | prefill + 2 tokens ms | dynamo graphs | tokens = hf eager |")
    print("|---|---:|---:|---:|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms_per_token']:.3f} | {r['first_2_tokens_ms']:.1f} | "
              f"{r['dynamo_graphs']} | {'yes' if r['same_as_hf_eager'] else 'no'} |")
    ok = rows["tpcompile reduce-overhead"]["same_as_tpcompile_eager"]
    print("\nOK" if ok else "\nFAILED: tpcompile's compiled tokens differ from its eager tokens")
    return 0 if ok else 1


def main(argv=None) -> int:
    return hf_check("hf-decode", parse(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
