"""``tpcompile demo``: parallelize a built-in model on local gloo ranks and check it.

Prints the plan (parameter, style, global -> local shape), the collectives per forward and
backward, and the largest output and gradient error against the unsharded model.
"""

from __future__ import annotations

import time

from tpcompile.tools import models
from tpcompile.tools.launch import run_on_ranks

__all__ = ["run_demo"]


def _rank_main(rank: int, world_size: int, model_name: str, batch: int, seq: int,
               options: dict) -> dict:
    from tpcompile.api import parallelize
    from tpcompile.tools.numerics import compare, sharded_output_losses

    model = models.build(model_name)
    inputs = models.example_inputs(model, batch, seq)
    start = time.perf_counter()
    tp = parallelize(model, inputs, **options)
    planned = time.perf_counter() - start
    # under loss_parallel the logits stay this rank's vocabulary shard: compared through the loss
    losses = sharded_output_losses(tp) if options.get("loss_parallel") else None
    result = compare(model, tp, inputs, steps=3, losses=losses)
    local = sum(p.numel() * p.element_size() for p in tp.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"plan": str(tp.plan), "seconds": planned, "comparison": result,
            "local_bytes": local, "full_bytes": full}


def run_demo(model: str = "llama", world_size: int = 2, batch: int = 2, seq: int = 16,
             **options) -> int:
    """``options``: ``parallelize``'s ``vocab_parallel`` / ``loss_parallel`` /
    ``sequence_parallel``; with ``loss_parallel`` the output compared is the next-token loss."""
    start = time.perf_counter()
    chosen = "".join(f", {k.replace('_', ' ')}" for k, on in sorted(options.items()) if on)
    print(f"tpcompile demo: {model} on {world_size} gloo ranks (CPU), batch {batch}, seq {seq}"
          f"{chosen}")
    results = run_on_ranks("tpcompile.tools.demo:_rank_main", world_size, model, batch, seq, options)
    r0 = results[0]
    cmp = r0["comparison"]
    print(r0["plan"])
    for phase in ("forward", "backward"):
        kinds = ", ".join(f"{n} x {k}" for k, n in sorted(cmp.collectives[phase].items())) or "none"
        print(f"collectives per {phase}: {kinds}")
    print(f"parameter bytes per rank: {r0['local_bytes']:,} of {r0['full_bytes']:,} "
          f"({r0['local_bytes'] / r0['full_bytes']:.0%})")
    worst_out = max(r["comparison"].output_err for r in results)
    worst_grad = max(r["comparison"].max_grad_err for r in results)
    worst_step = max(r["comparison"].max_step_err for r in results)
    ok = worst_out <= 1e-5 and worst_grad <= 1e-5 and worst_step <= 1e-4
    output = "output (projected: logits left sharded)" if options.get("loss_parallel") else "output"
    print(f"max relative error vs unsharded model: {output} {worst_out:.2e}, "
          f"gradients {worst_grad:.2e}, parameters after 3 AdamW steps {worst_step:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    print(f"parallelize took {r0['seconds']:.2f}s on rank 0; demo took {time.perf_counter() - start:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(run_demo())
