"""Print, as JSON, the plan and every rank's rewritten code for a few models (no process group).

tests/unit/test_determinism.py runs this in fresh interpreters with different PYTHONHASHSEED
values (PYTHONPATH as pyproject gives the tests), one of them beside a busy loop and with
``TPCOMPILE_PROBE_NODE_HASH`` set, and compares the outputs byte for byte.

``TPCOMPILE_PROBE_NODE_HASH=seed`` gives every ``fx.Node`` a hash drawn from a generator of that
seed. CPython iterates a set of nodes (or a dict keyed by them, once resized) in the order of
their hashes, which are their ``id()``s: addresses that depend on what the process allocated
and freed before, and so on the load and the timing of garbage collections. Drawn hashes
stand for any such order, so code that lets one reach the plan or the graph shows here.
"""

from __future__ import annotations

import json
import os
import random
import sys

import torch
from torch import nn

from bench import hf_sweep
from support import rewrite_ranks
from tpcompile.tools import models
from tpcompile.runtime.agreement import digest
from zoo import random_models


class SetOrder(nn.Module):
    """One MLP branch per entry of a set of strings, run in the set's order, which follows the
    hash seed (transformers' Gemma 3 builds its rotary tables this way): capture must not."""

    KINDS = {"full", "sliding", "local", "chunked"}  # orders differ for PYTHONHASHSEED 0 and 4242

    def __init__(self):
        super().__init__()
        self.up = nn.ModuleDict({k: nn.Linear(16, 32) for k in sorted(self.KINDS)})
        self.down = nn.ModuleDict({k: nn.Linear(32, 16) for k in sorted(self.KINDS)})

    def forward(self, x):
        outs = {k: self.down[k](torch.relu(self.up[k](x))) for k in self.KINDS}
        return sum(outs[k] for k in sorted(outs))


def shuffle_node_hashes(seed: int) -> None:
    """Every fx.Node hashes to a number drawn from a generator of ``seed`` (see the module doc)."""
    draw = random.Random(seed).getrandbits

    def node_hash(node) -> int:
        if "_probe_hash" not in node.__dict__:
            node.__dict__["_probe_hash"] = draw(62)
        return node.__dict__["_probe_hash"]

    torch.fx.Node.__hash__ = node_hash


def cases():
    yield "set_order", SetOrder(), (torch.randn(2, 5, 16),), 2, {}
    # transformers' Gemma 3 loops over set(config.layer_types); the sweep's tiny config
    yield "hf_gemma3", hf_sweep.build("Gemma3ForCausalLM"), (hf_sweep.example_ids(),), 2, {}
    llama = models.build("llama", dim=48, n_heads=6, n_kv_heads=2, hidden=100, vocab=97, n_layers=1)
    gpt2 = models.build("gpt2", n_layers=1)
    yield "llama_uneven", llama, models.example_inputs(llama), 3, {}
    yield "gpt2", gpt2, models.example_inputs(gpt2), 4, {"vocab_parallel": True}
    for name, case in random_models.corpus().items():
        model, x = random_models.build(case["spec"])
        yield name, model, x, case["world_size"], random_models.options(case["spec"])


def hf_cases(names: list[str] | None = None):
    """These families of the transformers sweep (default: every one) at 2 ranks, built lazily
    (a build may fail)."""
    for name in names or hf_sweep.families():
        yield name, lambda name=name: hf_sweep.build(name), (hf_sweep.example_ids(),), 2, {}


def probe(model, x, ws: int, options: dict) -> dict:
    plan, entries, graphs = rewrite_ranks(model, x, ws, **options)
    return {"plan": plan.to_json(), "codes": [gm.code for gm in graphs],
            "digests": [digest(e) for e in entries]}


def main(argv: list[str]) -> None:
    if os.environ.get("TPCOMPILE_PROBE_NODE_HASH"):
        shuffle_node_hashes(int(os.environ["TPCOMPILE_PROBE_NODE_HASH"]))
    out = {}
    if "--hf-all" in argv:  # optionally followed by family names
        for name, build, x, ws, options in hf_cases(argv[argv.index("--hf-all") + 1:]):
            try:
                out[name] = probe(build(), x, ws, options)
            except Exception as e:  # noqa: BLE001 - the error is the result, compared across runs
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    else:
        for name, model, x, ws, options in cases():
            out[name] = probe(model, x, ws, options)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
