"""The tpcompile command line: demo, explain, diff.

TARGET is a built-in model (llama, gpt2, mlp) or MODULE:FACTORY (a dotted module or a .py
file, and a function returning a model or (model, example_inputs)). Errors are one line and a
hint on stderr; usage errors exit with 2, failures to capture or plan with 1.
"""

from __future__ import annotations

import argparse
import sys
import time

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


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    p.add_argument("--world-size", type=int, required=True, help="number of tensor-parallel ranks")
    p.add_argument("--input-shape", metavar="SIZES",
                   help="example input shape, e.g. 2,128 (built-ins: BATCH,SEQ; default 2,16)")
    p.add_argument("--rank", type=int, default=0, help="whose local shapes / graph to show (default 0)")
    p.add_argument("--config", metavar="K=V,...",
                   help="built-in model config overrides, e.g. dim=4096,n_layers=32,n_heads=32")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device: plan large models without memory")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_options(p, list(OPTIONS))


OPTIONS = {"vocab-parallel": "shard token embeddings by vocabulary rows",
           "loss-parallel": "leave LM-head logits sharded by vocabulary",
           "sequence-parallel": "Megatron-SP: norms and residuals on sequence shards"}


def _add_options(p: argparse.ArgumentParser, names: list[str]) -> None:
    for name in names:
        p.add_argument(f"--{name}", action="store_true", help=f"{OPTIONS[name]} (parallelize's option)")


def _options(args) -> dict:
    """parallelize's plan options, from the flags of the same names that ``args`` has."""
    names = (name.replace("-", "_") for name in OPTIONS)
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
    _add_options(demo, ["vocab-parallel", "sequence-parallel"])
    explain = sub.add_parser("explain", help="show the plan: styles, collectives, bytes, fallbacks",
                             description="Plan TARGET for --world-size ranks without any process "
                                         "group and report what tpcompile would do.")
    _add_target(explain)
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    diff = sub.add_parser("diff", help="the graph before and after the rewrite",
                          description="Unified diff of TARGET's captured graph against one rank's "
                                      "rewritten graph (or an HTML side-by-side page).")
    _add_target(diff)
    diff.add_argument("--passes", action="store_true", help="one diff per pass")
    diff.add_argument("--html", metavar="FILE", help="write a side-by-side HTML page to FILE")
    return p


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
    from tpcompile.inspect.explain import explain

    target, progress = _load(args)
    report = explain(target.model, target.inputs, args.world_size, rank=args.rank, progress=progress,
                     **_options(args))
    progress("done")
    print(report.to_json() if args.json else report)
    return 0


def _diff(args) -> int:
    from tpcompile.inspect.diff import diff
    from tpcompile.tools.cli_targets import UsageError

    target, progress = _load(args)
    result = diff(target.model, target.inputs, args.world_size, rank=args.rank,
                  passes=args.passes, progress=progress, **_options(args))
    progress("done")
    if not args.html:
        print(result, end="")
        return 0
    try:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(result.to_html())
    except OSError as e:
        raise UsageError(f"cannot write {args.html}: {e.strerror}", "give a writable path") from e
    print(f"wrote {args.html}: {len(result.collectives)} collectives, "
          f"{len(result.relocalized)} rewritten shape constants")
    return 0


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
        return {"demo": _demo, "explain": _explain, "diff": _diff}[args.command](args)
    except UsageError as e:
        print(f"tpcompile {args.command}: error: {e.message}\n  hint: {e.hint}", file=sys.stderr)
        return e.exit_code
    except TPCompileError as e:  # its message is already "what went wrong\n  hint: the way out"
        text = str(e) if "hint:" in str(e) else f"{e}\n  hint: see docs/guarantees.md"
        print(f"tpcompile {args.command}: error: {text}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
