"""The tpcompile command line: demo, explain, diff, advise.

TARGET is a built-in model (llama, gpt2, mlp) or MODULE:FACTORY (a dotted module or a .py
file, and a function returning a model or (model, example_inputs)). Errors are one line and a
hint on stderr; usage errors exit with 2, failures to capture or plan with 1.
"""

from __future__ import annotations

import argparse
import sys
import time

from tpcompile.core.plan import EXPERT_MODES
from tpcompile.tools.models import MODELS

__all__ = ["main"]

TARGET_HELP = (f"a built-in model ({', '.join(sorted(MODELS))}) or MODULE:FACTORY, e.g. "
               "my_models.py:build (the factory returns a model or (model, example_inputs))")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the same one-line-plus-hint form as everything else."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n  hint: see `{self.prog} --help`\n")


class _Progress:
    """Timestamped progress lines on stderr, so stdout stays clean for --json and diffs."""

    def __init__(self, quiet: bool):
        self.quiet, self.start = quiet, time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def _add_target(p: argparse.ArgumentParser, ranks: bool = True) -> None:
    p.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    if ranks:
        p.add_argument("--world-size", type=int, required=True, help="number of tensor-parallel ranks")
    p.add_argument("--input-shape", metavar="SIZES",
                   help="example input shape, e.g. 2,128 (built-ins: BATCH,SEQ; default 2,16)")
    if ranks:
        p.add_argument("--rank", type=int, default=0,
                       help="whose local shapes / graph to show (default 0)")
    p.add_argument("--config", metavar="K=V,...",
                   help="built-in model config overrides, e.g. dim=4096,n_layers=32,n_heads=32")
    if ranks:
        p.add_argument("--meta", action="store_true",
                       help="build the model on the meta device: plan large models without memory")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_options(p, list(OPTIONS))
    p.add_argument("--experts", choices=EXPERT_MODES, default="tensor",
                   help="how stacked expert weights are cut (parallelize's option)")


OPTIONS = {"vocab-parallel": "shard token embeddings by vocabulary rows",
           "loss-parallel": "leave LM-head logits sharded by vocabulary",
           "sequence-parallel": "Megatron-SP: norms and residuals on sequence shards"}


def _add_options(p: argparse.ArgumentParser, names: list[str]) -> None:
    for name in names:
        p.add_argument(f"--{name}", action="store_true", help=f"{OPTIONS[name]} (parallelize's option)")


def _options(args) -> dict:
    """parallelize's plan options, from the flags of the same names that ``args`` has."""
    names = [name.replace("-", "_") for name in OPTIONS] + ["experts"]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tpcompile", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="parallelize a built-in model on local gloo ranks and check it",
                          description="Parallelize a built-in model on local gloo ranks (CPU) and "
                                      "compare it with the unsharded model.")
    demo.add_argument("--model", choices=sorted(MODELS), default="llama")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--seq", type=int, default=16)
    demo.add_argument("--generate", action="store_true",
                      help="greedy generation of a tiny Hugging Face Llama (needs transformers)")
    _add_options(demo, ["vocab-parallel", "loss-parallel", "sequence-parallel"])
    explain = sub.add_parser("explain", help="show the plan: styles, collectives, bytes, fallbacks",
                             description="Plan TARGET for --world-size ranks without any process "
                                         "group and report what tpcompile would do.")
    _add_target(explain)
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    explain.add_argument("--html", metavar="FILE",
                         help="write a self-contained HTML page with a picture of the plan to FILE")
    diff = sub.add_parser("diff", help="the graph before and after the rewrite",
                          description="Unified diff of TARGET's captured graph against one rank's "
                                      "rewritten graph (or an HTML side-by-side page).")
    _add_target(diff)
    diff.add_argument("--passes", action="store_true", help="one diff per pass")
    diff.add_argument("--html", metavar="FILE", help="write a side-by-side HTML page to FILE")
    _add_advise(sub)
    return p


def _add_advise(sub) -> None:
    from tpcompile.passes.planner.devices import PRESETS

    advise = sub.add_parser(
        "advise", help="which TP x FSDP split, checkpointing and SP: memory and step time",
        description="Plan TARGET (on the meta device) at every tensor-parallel degree dividing "
                    "--gpus, with and without sequence parallelism (only with it given "
                    "--sequence-parallel), and estimate per-rank memory, traffic and step time "
                    "of each data-parallel (FSDP2 or replicas) and checkpointing choice from a "
                    "stated cost model (docs/visualize.md).")
    _add_target(advise, ranks=False)
    advise.add_argument("--gpus", type=int, required=True, help="GPUs to split into TP x DP")
    advise.add_argument("--device", choices=sorted(PRESETS),
                        help="device preset (datasheet numbers; see docs/visualize.md)")
    advise.add_argument("--flops", type=float, metavar="F",
                        help="peak matmul FLOP/s for the model's dtype (overrides the preset)")
    advise.add_argument("--link-gbps", type=float, metavar="B",
                        help="GPU-to-GPU bandwidth per direction in Gbit/s (overrides the preset)")
    advise.add_argument("--memory-gib", type=float, metavar="M",
                        help="memory per GPU in GiB (overrides the preset)")
    advise.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="cast the model's floating parameters first (default: as built)")
    advise.add_argument("--efficiency", type=float, default=0.5,
                        help="share of peak FLOP/s reached (default 0.5)")
    advise.add_argument("--inference", action="store_true",
                        help="forward only: parameters + KV cache, no gradients or optimizer")
    advise.add_argument("--checkpointing", metavar="MODES", default="none,selective,full",
                        help="activation checkpointing modes to weigh (default none,selective,full)")
    advise.add_argument("--fsdp", choices=("both", "yes", "no"), default="both",
                        help="data parallelism to weigh: FSDP2, replicas, or both (default)")
    advise.add_argument("--json", action="store_true", help="print the advice as JSON")


def _load(args):
    from tpcompile.tools.cli_targets import UsageError, load_target, parse_config, parse_shape

    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}", "e.g. --world-size 8")
    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank {args.rank} is not a rank of {args.world_size}",
                         f"choose 0..{args.world_size - 1}")
    shape = parse_shape(args.input_shape) if args.input_shape else None
    progress = _Progress(args.quiet)
    target = load_target(args.target, shape, parse_config(args.config), args.meta)
    progress(f"built {args.target}" + (" on the meta device" if args.meta else ""))
    return target, progress


def _explain(args) -> int:
    from tpcompile.inspect.explain.explain import explain

    target, progress = _load(args)
    result = explain(target.model, target.inputs, args.world_size, rank=args.rank, progress=progress,
                     html=bool(args.html), **_options(args))
    progress("done")
    if args.html:
        _write(args.html, result)
        print(f"wrote {args.html}: the plan of {args.target} on {args.world_size} ranks")
        return 0
    print(result.to_json() if args.json else result)
    return 0


def _write(path: str, text: str) -> None:
    from tpcompile.tools.cli_targets import UsageError

    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}", "give a writable path") from e


def _diff(args) -> int:
    from tpcompile.inspect.diff.diff import diff

    target, progress = _load(args)
    result = diff(target.model, target.inputs, args.world_size, rank=args.rank,
                  passes=args.passes, progress=progress, **_options(args))
    progress("done")
    if not args.html:
        print(result, end="")
        return 0
    _write(args.html, result.to_html())
    print(f"wrote {args.html}: {len(result.collectives)} collectives, "
          f"{len(result.relocalized)} rewritten shape constants")
    return 0


def _advise(args) -> int:
    from tpcompile.inspect.advise.advise import advise
    from tpcompile.tools.cli_targets import load_target, parse_config, parse_shape

    cost = _cost_model(args)
    shape = parse_shape(args.input_shape) if args.input_shape else None
    progress = _Progress(args.quiet)
    target = load_target(args.target, shape, parse_config(args.config), meta=True)
    if args.dtype:
        import torch
        target.model.to(getattr(torch, args.dtype))
    progress(f"built {args.target} on the meta device")
    options = _options(args)
    sp = (True,) if options.pop("sequence_parallel") else (False, True)
    fsdp = {"both": (False, True), "yes": (True,), "no": (False,)}[args.fsdp]
    result = advise(target.model, target.inputs, args.gpus, cost, progress=progress,
                    checkpointing=_modes(args.checkpointing), fsdp=fsdp,
                    sequence_parallel=sp, **options)
    progress("done")
    print(result.to_json() if args.json else result)
    return 0


def _modes(text: str) -> list:
    """``--checkpointing``'s comma-separated modes as ``parallelize``'s values."""
    from tpcompile.tools.cli_targets import UsageError

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("none", "selective", "full")]
    if bad or not modes:
        raise UsageError(f"--checkpointing takes none, selective and full, got {text!r}",
                         "e.g. --checkpointing none,full")
    return [None if m == "none" else m for m in modes]


def _cost_model(args):
    """The device preset with the flags' overrides; every number needed must come from one."""
    from dataclasses import replace

    from tpcompile.inspect.advise.costs import CostModel
    from tpcompile.passes.planner.devices import PRESETS, Device
    from tpcompile.tools.cli_targets import UsageError

    if args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {args.gpus}", "e.g. --gpus 8")
    if not 0 < args.efficiency <= 1:
        raise UsageError(f"--efficiency must be in (0, 1], got {args.efficiency}", "e.g. 0.4")
    given = {"flops": args.flops, "link-gbps": args.link_gbps, "memory-gib": args.memory_gib}
    for flag, value in given.items():
        if value is not None and value <= 0:
            raise UsageError(f"--{flag} must be positive, got {value:g}", f"e.g. --{flag} 400")
    if args.device:
        device = PRESETS[args.device]
    elif None in given.values():
        missing = ", ".join(f"--{k}" for k, v in given.items() if v is None)
        raise UsageError(f"no --device and no {missing}",
                         f"pick a preset (--device {'|'.join(sorted(PRESETS))}) or give "
                         "--flops, --link-gbps and --memory-gib")
    else:
        device = Device("custom", "given on the command line", bf16_flops=args.flops,
                        fp32_flops=args.flops, link_gbps=args.link_gbps, memory_gib=args.memory_gib)
    if args.device and any(v is not None for v in given.values()):
        device = replace(device, name=device.name + " (overridden)",
                         bf16_flops=args.flops or device.bf16_flops,
                         fp32_flops=args.flops or device.fp32_flops,
                         link_gbps=args.link_gbps or device.link_gbps,
                         memory_gib=args.memory_gib or device.memory_gib)
    return CostModel(device, compute_efficiency=args.efficiency, inference=args.inference)


def _demo(args) -> int:
    from tpcompile.tools.demo import run_demo
    from tpcompile.tools.cli_targets import UsageError

    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}", "e.g. --world-size 2")
    if args.generate:
        from tpcompile.tools.demo_generate import run_generate_demo
        return run_generate_demo(args.world_size)
    return run_demo(args.model, args.world_size, args.batch, args.seq, **_options(args))


def main(argv: list[str] | None = None) -> int:
    from tpcompile.errors import TPCompileError
    from tpcompile.tools.cli_targets import UsageError

    args = _parser().parse_args(argv)
    try:
        return {"demo": _demo, "explain": _explain, "diff": _diff,
                "advise": _advise}[args.command](args)
    except UsageError as e:
        print(f"tpcompile {args.command}: error: {e.message}\n  hint: {e.hint}", file=sys.stderr)
        return e.exit_code
    except TPCompileError as e:  # its message is already "what went wrong\n  hint: the way out"
        text = str(e) if "hint:" in str(e) else f"{e}\n  hint: see docs/guarantees.md"
        print(f"tpcompile {args.command}: error: {text}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
