"""One module, several call signatures: a prefill call and one-token decode calls.

torch.export fixes a dimension of size 1 (it specialises 0 and 1), so the graph captured for a
prompt of T tokens cannot run a decode step of one token, and one captured for a single token
runs nothing else. A :class:`TPModule` therefore keeps one rewritten graph per call
signature. Every graph reads the *same* tensors: a later capture is rewritten without
materializing weights, and :func:`bind_tensors` points its parameters and buffers at the
module's own, so the shards an optimizer updates and a KV cache a prefill wrote are what the
decode graph reads. :func:`written_buffers` names the buffers graphs write in place (a static
KV cache) for ``TPModule.reset_caches``.

A model may also keep tensors as plain attributes, neither parameters nor buffers: litgpt's
``mask_cache``, gpt-fast's ``freqs_cis`` or causal mask. Export reads them as constants of the
graph. A later capture runs on a meta copy of the model, where such an attribute must be meta
too (fake tensors refuse an op mixing CPU and meta tensors); :func:`plain_tensors` finds them,
the copy holds meta stand-ins, and :func:`bind_constants` gives the new graph their real
values.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from tpcompile.errors import TPCompileError

__all__ = ["MAX_SIGNATURES", "bind_constants", "bind_tensors", "plain_tensors", "written_buffers",
           "exact_fit"]

MAX_SIGNATURES = 8  # captures one module keeps (prefill and decode need two)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(list(module.named_parameters(remove_duplicate=False))
                + list(module.named_buffers(remove_duplicate=False)))


def bind_tensors(gm: fx.GraphModule, owner: nn.Module, plan=None, prefix: str = "",
                 rank: int = 0) -> None:
    """Make every parameter and buffer of ``gm`` the tensor of the same name in ``owner``.

    ``gm`` was rewritten without materializing its weights (it holds meta tensors); the caller
    has checked that it was planned as ``owner``'s first graph. ``prefix``: ``gm`` captured a
    wrapper holding the model there; the wrapper's own buffers (its KV cache) are allocated
    here as this rank's zero shards, from ``plan``, the ``ShardingPlan`` ``gm`` was rewritten
    under (None once every tensor of ``gm`` is ``owner``'s).
    """
    mine = _tensors(owner)
    device = next(iter(mine.values())).device if mine else torch.device("cpu")
    for name, t in _tensors(gm).items():
        held = mine.get(name) if not name.startswith(prefix) else mine.get(name[len(prefix):], mine.get(name))
        if held is None and plan is not None and name in plan.by_fqn and not isinstance(t, nn.Parameter):
            held = torch.zeros(plan.by_fqn[name].local_shapes[rank], dtype=t.dtype, device=device)
        if held is None:
            raise TPCompileError(
                f"the capture of a new call signature reads {name}, which the module does not "
                "hold\n  hint: this is a tpcompile bug; please report it")
        owner_mod, _, leaf = name.rpartition(".")
        sub = gm.get_submodule(owner_mod) if owner_mod else gm
        (sub._parameters if leaf in sub._parameters else sub._buffers)[leaf] = held


def plain_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> tensor of every tensor ``model``'s modules hold as a plain attribute (not a
    parameter or buffer: ``self.mask_cache = build_mask_cache(...)``)."""
    out = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                out[f"{path}.{attr}" if path else attr] = value
    return out


def bind_constants(gm: fx.GraphModule, constants: dict[str, torch.Tensor], device,
                   prefix: str = "") -> None:
    """Give every meta constant ``gm`` reads (a plain tensor attribute of the meta copy it was
    captured on) the real tensor of the same name in ``constants``, on ``device``.

    ``prefix``: ``gm`` captured a wrapper holding the model there. A constant export built
    in forward (``torch.tensor([...])``) holds its real value already and is left alone.
    """
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, leaf = node.target.rpartition(".")
        sub = gm.get_submodule(owner) if owner else gm
        value = getattr(sub, leaf)
        if (not isinstance(value, torch.Tensor) or value.device.type != "meta"
                or leaf in sub._parameters or leaf in sub._buffers):
            continue
        name = node.target[len(prefix):] if node.target.startswith(prefix) else node.target
        real = constants.get(name, constants.get(node.target))
        if real is None:
            raise TPCompileError(
                f"the capture of a new call signature reads the tensor attribute {name}, whose "
                "value the module does not hold\n  hint: this is a tpcompile bug; please report it")
        if real.device.type == "meta":  # as to_empty says of the first graph's constants
            raise TPCompileError(
                f"the capture of a new call signature reads the tensor constant {name}, created on "
                "the meta device: its value was never computed; register it as a buffer in the "
                "model instead")
        setattr(sub, leaf, real.to(device))


def written_buffers(gm: fx.GraphModule) -> list[str]:
    """Buffers the graph writes in place (through views): a static KV cache, in graph order."""
    buffers = {name for name, _ in gm.named_buffers()}
    out = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not target._schema.is_mutable or not node.args:
            continue
        base = node.args[0]
        while isinstance(base, fx.Node) and _is_view(base):
            base = base.args[0]
        if isinstance(base, fx.Node) and base.op == "get_attr" and base.target in buffers:
            if base.target not in out:
                out.append(base.target)
    return out


def _is_view(node: fx.Node) -> bool:
    """An op whose output shares its first input's storage (a slice, a transpose)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None
                and node.args and not schema.is_mutable)


def exact_fit(spec, args: tuple, kwargs: dict) -> bool | None:
    """Whether the graph of ``spec`` was captured for this call's sizes.

    True: every fixed size matches, every symbolic one is in its range and not 0 or 1 (export
    traced symbolic sizes as >= 2). False: the same call with a symbolic size at 0 or 1 or
    past its range (a new signature, worth a capture of its own). None: another call (other
    inputs, ranks, dtypes, or a size the graph fixes): the call check names what is wrong.
    """
    try:
        flat = spec._flatten(args, kwargs)
    except Exception:  # noqa: BLE001 - the call check reports it
        return None
    fits = True
    for want, got in zip(spec.expected, flat):
        if want is None:
            continue
        if not isinstance(got, torch.Tensor) or got.dim() != len(want.shape) or got.dtype != want.dtype:
            return None
        for d, (size, limit) in enumerate(zip(want.shape, want.limits or [None] * got.dim())):
            n = got.shape[d]
            if size is not None and n != size:
                return None  # a size the model fixes (a cache's batch rows), not a signature
            if size is None and limit is not None and limit.high is not None and n > limit.high:
                return None  # past the model's own limit: the call check says so
            fits &= size is not None or n >= 2
    return fits
