"""Collectives and bytes per training step against Megatron's lower bound, every test model.

    python -m bench.communication               # markdown table, JSON in bench/results/
    python -m bench.communication --world-sizes 2 4 8

No process group: each model is captured, planned and rewritten for rank 0
(:func:`tpcompile.inspect.trace.trace_rewrite`), and the collectives are read from the rewritten
graph itself (:func:`tpcompile.inspect.traffic.list_collectives`), forward and backward, each with the
size of the whole tensor it reduces or assembles. Megatron's bound is derived from the model
(:mod:`tpcompile.inspect.bound.bound`): one forward all-reduce per group of summed row-parallel
outputs and one backward all-reduce per activation entering the column-parallel matmuls, per
repeated block. *Excess* is every collective on none of the values the bound reduces; each is
listed with the value it converts, so a non-zero entry says what to look at.

The models are the ones the gloo numerics tests run: the built-in MLP, GPT-2 (fused qkv, tied
embeddings) and Llama (GQA 8 query / 2 KV heads, RoPE, SwiGLU), and when ``transformers`` is
installed its Llama, Llama with one KV head (MQA), GPT-2 and BERT at the tests' tiny configs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tpcompile.tools import models
from tpcompile.inspect.trace import trace_rewrite
from tpcompile.inspect.traffic import list_collectives, megatron_comparison
from tpcompile.passes.planner.rules import viewed_from

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, SEQ = 2, 16


def _hf_models() -> dict:
    """name -> (factory, inputs): the transformers models of the gloo tests, at their configs."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {}
    from zoo.hf_models import hf_model  # the gloo tests' HF configs

    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {f"hf {name}": (lambda n=name: hf_model(n), (tokens,))
            for name in ("llama", "llama_mqa", "gpt2", "bert")}


def model_matrix() -> dict:
    out = {}
    for name in ("mlp", "gpt2", "llama"):
        model = models.build(name)
        out[name] = ((lambda n=name: models.build(n)), models.example_inputs(model, BATCH, SEQ))
    out.update(_hf_models())
    return out


def measure(name: str, factory, inputs, world_size: int) -> dict:
    torch.manual_seed(0)
    model = factory().eval()
    trace = trace_rewrite(model, inputs, world_size, copy_weights=False)
    collectives = list_collectives(trace)
    layers = megatron_comparison(trace, collectives)
    blocks = trace.bound.blocks.values()
    bound_nodes = {"forward": {n for b in blocks for n in b.values["forward"]},
                   "backward": _viewed({n for b in blocks for n in b.values["backward"]},
                                       trace.cap.gm)}
    # a bucketed gradient sync is on the bound when one of its values is
    excess = [c for c in collectives if not bound_nodes[c.phase].intersection(c.values)]
    return {
        "model": name, "world_size": world_size,
        "bound_collectives": sum(t.bound_forward + t.bound_backward for t in layers),
        "collectives": len(collectives),
        "bound_bytes": sum(t.bound_bytes for t in layers),
        "bytes": sum(c.bytes or 0 for c in collectives),
        "by_op": {f"{c.phase} {c.op}": sum(1 for d in collectives if (d.phase, d.op) == (c.phase, c.op))
                  for c in collectives},
        "excess": [{"phase": c.phase, "op": c.op, "node": c.node, "module": c.module,
                    "bytes": c.bytes} for c in excess],
    }


def _viewed(names: set, gm) -> set:
    """``names`` and the values they are views of: a matmul's activation is often a view of
    the value whose gradient sync sits before it (GPT-2's Conv1D reads ``view(norm)``)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return set(names) | {v.name for name in names if name in nodes for v in viewed_from(nodes[name])}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | ranks | collectives / step | Megatron bound | excess | bytes / step "
             "| bound bytes | excess bytes | excess collectives on |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        on = sorted({f"{e['phase']} {e['op']} {e['node']}" for e in r["excess"]})
        shown = ", ".join(on[:3]) + (f", ... ({len(on)} values)" if len(on) > 3 else "")
        lines.append(
            f"| {r['model']} | {r['world_size']} | {r['collectives']} | {r['bound_collectives']} "
            f"| {r['collectives'] - r['bound_collectives']} | {r['bytes']:,} | "
            f"{r['bound_bytes']:,} | {r['bytes'] - r['bound_bytes']:,} | {shown or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    args = p.parse_args(argv)
    rows = [measure(name, factory, inputs, ws)
            for name, (factory, inputs) in model_matrix().items() for ws in args.world_sizes]
    table = markdown(rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "communication.json").write_text(json.dumps(
        {"torch": torch.__version__, "batch": BATCH, "seq": SEQ, "rows": rows}, indent=1))
    (RESULTS / "communication.md").write_text(table + "\n")
    print(table)
    return rows


if __name__ == "__main__":
    main()
