"""The package's layers, bottom to top: an import inside tpcompile goes down or stays level.

The order tells the pipeline's story: errors, the bridges between torch releases (compat) and
this contract, then capture and the plan's data types (core), what rewritten graphs call at
run time (runtime), the passes (the planner's analyses and rule table, then the passes that
prepare or rewrite the graph with them, then the pipeline that runs them all), ``parallelize``
(api), the features built on it (compile, inspect, state), and the tools on top. A module
importing upwards would let stage 1 depend on stage 4. tests/unit/test_layers.py checks every
import against :data:`LAYERS`; docs/generate.py lays out design.md's module map in its order.
Parts are paths from the repository root (``passes/`` installs as ``tpcompile.passes``).
"""

from __future__ import annotations

__all__ = ["LAYERS", "layer_modules"]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("tpcompile/errors.py", "tpcompile/compat.py", "tpcompile/layers.py"),
    ("tpcompile/core",),
    ("tpcompile/runtime",),
    ("passes/planner",),
    ("passes/prepare", "passes/rewrite"),
    ("passes/pipeline.py", "passes/__init__.py"),
    ("tpcompile/api.py",),
    ("tpcompile/compile", "tpcompile/inspect", "tpcompile/state"),
    ("tpcompile/tools",),
)


def layer_modules() -> list[set[str]]:
    """:data:`LAYERS` as importable module names, bottom to top."""
    def module(part: str) -> str:
        name = part.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        return "tpcompile." + name if name.startswith("passes") else name
    return [{module(part) for part in layer} for layer in LAYERS]
