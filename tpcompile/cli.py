"""The ``tpcompile`` command line."""

from __future__ import annotations

import argparse
import sys

from tpcompile.models import MODELS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpcompile", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="parallelize a built-in model on local gloo ranks and check it")
    demo.add_argument("--model", choices=sorted(MODELS), default="llama")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--seq", type=int, default=16)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from tpcompile.demo import run_demo
        if args.world_size < 1:
            print("tpcompile: error: --world-size must be >= 1", file=sys.stderr)
            return 2
        return run_demo(args.model, args.world_size, args.batch, args.seq)
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
