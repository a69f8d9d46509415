"""Benchmark: bytes per rank of torchao 0.18's inference configs on a tiny Hugging Face Llama.

Usage: python -m bench.torchao_bytes [--world-size 2] [--out bench/results/torchao-bytes.md]

Each config of ``zoo/quant_models.TORCHAO`` quantizes the block linears of
``zoo.hf_models.hf_causal_lm("llama")`` (hidden 64, 2 layers, 4 heads / 2 kv heads, vocab
256; int4 in groups of 32), which is parallelized under ``torch.no_grad`` on gloo ranks. Per
config it records what rank 0's module holds (every parameter and buffer, the quantized parts
apart), against the unsharded quantized model's tensors (subclass weights counted by their
parts), the forward collectives and the largest relative error of the logits. The markdown
table it writes is what docs/generation.md quotes.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tpcompile.tools.launch import run_on_ranks


def _nbytes(t: torch.Tensor) -> int:
    """A tensor's bytes; a subclass weight's are its parts'."""
    if is_traceable_wrapper_subclass(t):
        return sum(_nbytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def measure(rank: int, world_size: int, names: list[str]) -> dict:
    """config -> rank's bytes (all, quantized parts), unsharded bytes, collectives, error."""
    import tpcompile
    from tpcompile.runtime.collectives import count_collectives
    from tpcompile.tools.numerics import rel_err
    from zoo import quant_models
    from zoo.hf_models import hf_causal_lm, hf_prompt

    ids, mask = hf_prompt()
    out = {}
    for name in names:
        model = quant_models.torchao_blocks(hf_causal_lm("llama").eval(), name)
        with torch.no_grad():
            tp = tpcompile.parallelize(model, (ids,), example_kwargs={"attention_mask": mask})
            err = rel_err(tp(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
        held = dict(tp.named_parameters()) | dict(tp.named_buffers())
        parts = set(quant_models.subclass_part_names(tp))
        whole = dict(model.named_parameters()) | dict(model.named_buffers())
        quantized = [t for t in whole.values() if is_traceable_wrapper_subclass(t)]
        out[name] = {"rank_bytes": sum(_nbytes(t) for t in held.values()),
                     "rank_part_bytes": sum(_nbytes(t) for n, t in held.items() if n in parts),
                     "bytes": sum(_nbytes(t) for t in whole.values()),
                     "part_bytes": sum(_nbytes(t) for t in quantized),
                     "collectives": count_collectives(tp.graph_module)["forward"],
                     "err": err}
    return out


def table(results: dict, world_size: int) -> list[str]:
    rows = ["| config | quantized parts per rank | of unsharded | all tensors per rank | of "
            "unsharded | forward collectives | max rel. error |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        coll = ", ".join(f"{n} x {op}" for op, n in sorted(r["collectives"].items())) or "none"
        rows.append(f"| {name} | {r['rank_part_bytes']:,} | {r['part_bytes']:,} "
                    f"({r['rank_part_bytes'] / r['part_bytes']:.0%}) | {r['rank_bytes']:,} | "
                    f"{r['bytes']:,} ({r['rank_bytes'] / r['bytes']:.0%}) | {coll} | "
                    f"{r['err']:.1e} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default=None, help="write the markdown table here")
    args = p.parse_args()
    from zoo.quant_models import TORCHAO

    results = run_on_ranks("bench.torchao_bytes:measure", args.world_size, list(TORCHAO),
                           timeout=1200)[0]
    import torchao

    lines = [f"# torchao {torchao.__version__} configs: bytes per rank at {args.world_size} "
             f"gloo ranks ({datetime.date.today()})", "",
             f"Command: `python -m bench.torchao_bytes {' '.join(sys.argv[1:])}` "
             f"(torch {torch.__version__}, CPU); rank 0's module against the unsharded "
             "quantized model.", "", *table(results, args.world_size)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
