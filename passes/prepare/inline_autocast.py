"""Autocast scopes are inlined between their own enter and exit calls, so the planner sees their ops.

torch.export captures ``with torch.autocast(device, enabled=False): ...`` inside ``forward``
(Hugging Face's RoPE, norms computed in float32) as one ``higher_order.wrap_with_autocast``
call of a submodule: an op with no rule, whose every sharded input is gathered. This pass
puts the submodule's nodes in the graph in its place, between the two calls export itself
writes before wrapping them into the higher-order op (``torch.amp._enter_autocast`` and
``torch.amp._exit_autocast``, which FX keeps as side-effectful): the scope runs under the
same autocast state as before, whatever autocast the caller runs the model under, and every
op in it is planned by the rule table like any other. A scope inside a scope is inlined too.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from tpcompile.core.checkpoint_marks import REGION
from tpcompile.passes.prepare.subgraphs import copy_subgraph, replace_call

__all__ = ["inline_autocast_pass"]

_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
# what a node of the scope takes from the call it came from when it has none of its own
_INHERITED = ("stack_trace", "nn_module_stack", REGION)


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    """Replace one ``wrap_with_autocast(device, dtype, enabled, cache, body, *args)`` call."""
    state, body_node, args = call.args[:4], call.args[4], call.args[5:]
    body = getattr(gm, body_node.target)
    with gm.graph.inserting_before(call):
        enter = gm.graph.call_function(torch.amp._enter_autocast, tuple(state))
        # a constant or inner scope of the body moves up, named after it
        outputs, copies = copy_subgraph(
            gm, body, args, lambda target: f"{body_node.target}_{target.replace('.', '_')}")
        gm.graph.call_function(torch.amp._exit_autocast, (enter,))
    for copy in copies:
        for key in _INHERITED:
            if key in call.meta:
                copy.meta.setdefault(key, call.meta[key])
    replace_call(gm, call, outputs)  # the scope's results are read through getitem
    if not body_node.users:
        gm.graph.erase_node(body_node)
        delattr(gm, body_node.target)


def inline_autocast_pass(gm: fx.GraphModule) -> PassResult:
    """Every ``wrap_with_autocast`` call inlined (see the module docstring)."""
    done = 0
    while (call := next((n for n in gm.graph.nodes
                         if n.op == "call_function" and n.target is _AUTOCAST), None)) is not None:
        _inline(gm, call)
        done += 1
    return PassResult(gm, done > 0)
