"""Decoding under CUDA graphs: the decode step compiled with ``mode="reduce-overhead"``.

    bash bench/gpu.sh decode                 # torchrun, one rank per GPU (at most 2)
    python -m bench.gpu_decode --device cpu --layers 1 --dim 64 --heads 4 --kv-heads 2 \\
        --vocab 256 --new 4                  # a smoke run of the same code on CPU (no graphs)

A decoder that owns a static KV cache (``zoo/cache_models.py``, gpt-fast style) is
parallelized on every rank of the torchrun world (NCCL; run without torchrun it is a 1-rank
world). The prompt is prefilled eagerly, then greedy decode steps run three ways:

- ``unsharded eager``: the model itself on this GPU, the reference tokens;
- ``tpcompile eager``: the parallelized module (its decode signature: 2 all-reduces a layer);
- ``tpcompile reduce-overhead``: ``torch.compile`` of that module with tpcompile's inductor
  options and ``list_mode_options("reduce-overhead")`` (CUDA graphs), the all-reduces
  captured inside the graph. A first run compiles and records; the second is timed.

Checks: compiled tokens equal eager tokens; inductor skipped no CUDA graph
(``counters["inductor"]["cudagraph_skips"]``). At world size 1 the plan is the identity, so
the decode graph holds no collective to capture (the table says so): a machine with 2 GPUs
runs 2 ranks. Exit status 1 on a failed check. Per-token latency: median decode step (CUDA
synchronised), prefill excluded. Rank 0 prints a markdown table and writes
bench/results/gpu-decode-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"


def decoder_parser(description: str) -> argparse.ArgumentParser:
    """The decode checks' arguments: the device, the dtype and the decoder's shape (this
    script's decoder; bench/gpu_hf_decode.py builds a Hugging Face Llama of the same shape)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="float32 keeps greedy ties apart, so tokens compare exactly")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    return p


def parse(argv=None) -> argparse.Namespace:
    p = decoder_parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    if args.prompt < 2 or args.new < 2:
        p.error("--prompt and --new must be at least 2 (a prefill call and decode calls)")
    return args


def init_world(device: str) -> tuple[int, int]:
    """torchrun's world (NCCL on CUDA, gloo on CPU), or a 1-rank world without torchrun."""
    backend = "nccl" if device == "cuda" else "gloo"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local)
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def hf_check(check: str, args, run, report) -> int:
    """The entry of a GPU check on a Hugging Face model: a skip (exit 0) without CUDA or
    transformers, else ``run(args)``, its result written to results/gpu-<check>-<device>.json,
    and ``report``'s exit status."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench/gpu_{check.replace('-', '_')}.py: no CUDA device; skipped")
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"bench/gpu_{check.replace('-', '_')}.py: transformers is not installed; skipped")
        return 0
    result = run(args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"gpu-{check}-{args.device}.json").write_text(json.dumps(result, indent=1))
    return report(result)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def greedy_timed(prefill, decode, prompt, new: int, device: str) -> tuple[list, list[float]]:
    """Greedy tokens (prefill with ``prefill``, then ``new - 1`` steps of ``decode``) and the
    seconds of each decode step."""
    t = prompt.shape[1]
    logits = prefill(prompt, torch.arange(t, device=device))
    out, steps = [logits[:, -1].argmax(-1)], []
    for i in range(new - 1):
        pos = torch.tensor([t + i], device=device)
        _sync(device)
        start = time.perf_counter()
        logits = decode(out[-1][:, None], pos)
        token = logits[:, -1].argmax(-1)  # read before the next replay reuses the output
        _sync(device)
        steps.append(time.perf_counter() - start)
        out.append(token)
    return torch.stack(out, 1).tolist(), steps


def run(args) -> dict:
    import tpcompile
    from zoo.cache_models import CachedDecoder
    from torch._dynamo.utils import counters
    from torch._inductor import list_mode_options
    from tpcompile.runtime.collectives import count_collectives

    rank, world_size = init_world(args.device)
    # the cache's batch rows are fixed anyway: the example's batch of 1 loses nothing
    warnings.filterwarnings("ignore", message="tpcompile: input idx has size 1")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    max_seq = args.prompt + args.new
    model = CachedDecoder(vocab=args.vocab, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads,
                          layers=args.layers, batch=args.batch, max_seq=max_seq)
    model = model.to(args.device, dtype).eval()
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(1)).to(args.device)
    rows = {}
    with torch.no_grad():
        want, steps = greedy_timed(model, model, prompt, args.new, args.device)
        rows["unsharded eager"] = {"steps": steps, "tokens": want}
        tp = tpcompile.parallelize(model, (prompt, torch.arange(args.prompt, device=args.device)))
        del model  # the module keeps its shards only
        tokens, steps = greedy_timed(tp, tp, prompt, args.new, args.device)
        rows["tpcompile eager"] = {"steps": steps, "tokens": tokens}
        options = {**tpcompile.compile_options(), **list_mode_options("reduce-overhead")}
        compiled = torch.compile(tp, options=options)
        for _ in range(2):  # compile and record, then the timed run
            tp.reset_caches()
            tokens, steps = greedy_timed(tp, compiled, prompt, args.new, args.device)
        rows["tpcompile reduce-overhead"] = {"steps": steps, "tokens": tokens}
    decode_graph = tp.signatures[-1][1]
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "world_size": world_size, "torch": torch.__version__, "config": vars(args),
        "collectives_per_decode_step": count_collectives(decode_graph)["forward"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "rows": {name: {"ms_per_token": 1e3 * statistics.median(r["steps"]),
                        "same_as_eager": r["tokens"] == rows["tpcompile eager"]["tokens"],
                        "same_as_unsharded": r["tokens"] == want} for name, r in rows.items()},
    }
    dist.destroy_process_group()
    return result if rank == 0 else {}


def report(result: dict) -> int:
    """Print the table; 1 when compiled tokens differ from eager or a CUDA graph was skipped."""
    c = result["config"]
    collectives = result["collectives_per_decode_step"] or {"none (world size 1: identity plan)": 0}
    print(f"{result['device']}, {result['world_size']} rank(s), decoder {c['layers']} layers, dim "
          f"{c['dim']}, {c['heads']}/{c['kv_heads']} heads, batch {c['batch']}, prompt "
          f"{c['prompt']}, {c['new']} new tokens, {c['dtype']}")
    print(f"collectives per decode step: {collectives}; CUDA graphs skipped: "
          f"{result['cudagraph_skips']}\n")
    print("| path | ms / token | tokens / s | tokens = tpcompile eager | tokens = unsharded |")
    print("|---|---:|---:|---|---|")
    for name, r in result["rows"].items():
        print(f"| {name} | {r['ms_per_token']:.3f} | {1e3 / r['ms_per_token']:.0f} | "
              f"{'yes' if r['same_as_eager'] else 'NO'} | {'yes' if r['same_as_unsharded'] else 'no'} |")
    ok = result["rows"]["tpcompile reduce-overhead"]["same_as_eager"]
    ok &= c["device"] != "cuda" or result["cudagraph_skips"] == 0
    print("\nOK" if ok else "\nFAILED: compiled tokens differ from eager, or a CUDA graph was skipped")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_decode.py: no CUDA device; skipped")
        return 0
    result = run(args)
    if not result:
        return 0  # rank 0 reports
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"gpu-decode-{args.device}.json").write_text(json.dumps(result, indent=1))
    return report(result)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: there torch 2.11's gloo groups (the CPU rehearsal's) can
    # abort the finished rank ("terminate called without an active exception", SIGABRT; 1 of
    # 3 rehearsals), after the results are written; the exit status is the checks'
    os._exit(status)
