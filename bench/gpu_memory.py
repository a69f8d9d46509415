"""One rank's memory in a bf16 training step of a whole Llama-3-8B-shaped model at TP 8.

    bash bench/gpu.sh memory                 # skips (exit 0) without a CUDA device or transformers
    bash bench/gpu.sh memory --device cpu    # the rehearsal: the same code at tiny sizes

As a user builds it without ever holding the whole model: ``transformers.LlamaForCausalLM``
with the Llama-3 8B config (32 layers, dim 4096, 32 / 8 heads, hidden 14336, vocabulary 128256)
built on the meta device in bf16, ``tpcompile.parallelize`` over 8 ranks of a fake process
group (``torch.testing._internal.distributed.fake_pg``: this process is rank 0, the collectives
return at once), ``tpcompile.to_empty`` onto the GPU, shards filled with N(0, 0.02). Then
``--steps`` training steps of ``--batch`` x ``--seq`` tokens (the loss computed inside the
model from ``labels``, vocabulary-parallel) with ``torch.optim.AdamW`` (foreach, bf16 states).

Reports, on rank 0: the bytes of its parameters, and the ideal (whole model / 8 for every
tensor the plan cuts, plus the tensors it keeps whole); the peak of
``torch.cuda.max_memory_allocated`` over the last step (the optimizer's states exist by then);
and that peak minus parameters, gradients and AdamW's two states: activations and workspace.
The numbers of a fake group's collectives are garbage; its memory is that of a real rank.
Writes bench/results/gpu-memory-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.distributed as dist

from bench.gpu import _fake_world
from bench.gpu_decode import hf_check


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    return p.parse_args(argv)


def _gib(n: int) -> float:
    return n / 2**30


def run(args) -> dict:
    import transformers as tf
    import tpcompile

    _fake_world(args.world_size)
    warnings.filterwarnings("ignore", message="tpcompile: input .* has size 1")  # batch 1 is fixed
    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         rope_theta=500000.0)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    tp = tpcompile.parallelize(model, (ids.to("meta"),), example_kwargs={"labels": ids.to("meta")})
    tpcompile.to_empty(tp, args.device)
    with torch.no_grad():
        for p in tp.parameters():
            p.normal_(0, 0.02)
    params = sum(p.numel() * p.element_size() for p in tp.parameters())
    ideal = _ideal_bytes(model, tp, args.world_size)
    opt = torch.optim.AdamW(tp.parameters(), lr=1e-5, foreach=True)
    for step in range(args.steps):
        if step == args.steps - 1 and args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tp(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": tf.__version__, "config": vars(args),
            "whole_param_bytes": whole, "rank0_param_bytes": params, "ideal_param_bytes": ideal,
            "peak_bytes": peak, "rest_bytes": None if peak is None else peak - 4 * params}


def _ideal_bytes(model, tp, world_size: int) -> int:
    """Every parameter the plan cuts at 1/N of its whole size, the others whole."""
    from tpcompile.core.placement import Shard
    from tpcompile.core.shards import placements_by_fqn

    cut = placements_by_fqn(tp.plan)
    return sum(p.numel() * p.element_size() // (world_size if isinstance(cut.get(n), Shard) else 1)
               for n, p in model.named_parameters())


def report(r: dict) -> int:
    c = r["config"]
    print(f"{r['device']}, torch {r['torch']}, transformers {r['transformers']}: Llama-3 "
          f"{c['layers']} layers, dim {c['dim']}, {c['heads']}/{c['kv_heads']} heads, hidden "
          f"{c['hidden']}, vocab {c['vocab']}, bf16, {c['batch']}x{c['seq']} tokens, rank 0 of "
          f"TP {c['world_size']} (fake group), AdamW\n")
    peak = "-" if r["peak_bytes"] is None else f"{_gib(r['peak_bytes']):.2f}"
    rest = "-" if r["rest_bytes"] is None else f"{_gib(r['rest_bytes']):.2f}"
    print("| whole model GiB | rank 0 params GiB | ideal GiB | peak allocated GiB "
          "| peak - 4 x params GiB |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {_gib(r['whole_param_bytes']):.2f} | {_gib(r['rank0_param_bytes']):.2f} | "
          f"{_gib(r['ideal_param_bytes']):.2f} | {peak} | {rest} |")
    print(f"\nrank 0's parameters / ideal: {r['rank0_param_bytes'] / r['ideal_param_bytes']:.3f}")
    return 0


def main(argv=None) -> int:
    return hf_check("memory", parse(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
