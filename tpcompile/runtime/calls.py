"""Ranks agree on a call's inputs before the model's first collective.

``parallelize`` proves that ranks planned the same graph; each call must still feed every rank
the same shapes. If rank 0 calls with 16 tokens and rank 1 with 24, their all-reduces pair
buffers of different sizes: gloo aborts the process (``op.preamble.length <= op.nbytes``),
NCCL hangs or reads garbage. :class:`CallCheck` compares a description of the call (every
input's dtype and shape, other arguments, grad mode) across the group with one all-reduce of
``[digest, -digest]`` (MAX: every rank learns max and min at once) and raises
:class:`InputMismatchError` on every rank when they differ, before any model collective.

The check runs on a separate gloo group over the same ranks, never on the model's group: a
rank that checks while a peer is already inside a model collective (or still in its backward)
must not pair with it. On its own group a check that nobody answers ends as a
:class:`CollectiveError` after the group's timeout, like any lost collective, instead of an
abort. Its values live on the CPU, so an NCCL model pays no device sync for it.

Modes (``parallelize(check_calls=...)``):

- ``"new"`` (default): check a call whose description this module has not agreed on before,
  then remember it; a repeated call costs a dict lookup. Every rank's cache holds the same
  entries (only agreed calls enter it), so ranks all check or all skip *while they agree*.
  A rank that repeats an agreed call while a peer brings a new one is not caught as a
  mismatch: the peer's check and the rank's model collective wait on different groups and both
  end in a ``CollectiveError`` after the timeout. A forward with gradients is described
  together with whether the previous one's backward ran, so a rank that skips a backward and
  calls forward again brings a call new to it and checks it: its check waits while its peers
  wait in their backward, and every rank ends in a ``CollectiveError`` after the timeout (never
  a forward whose collectives pair with a peer's backward's, a silent wrong answer).
- ``"every"``: check every call, counting them, so a rank that skipped a forward or a backward
  (its next forward meets a peer still in a backward) or lost a call is named too. One tiny
  gloo all-reduce per call; see docs/performance.md for its cost.

The first call of each description also compares a digest of every input tensor's *values*
(token ids, positions, masks, float features; per tensor, its sum and a position-weighted sum in
float64: one pass over it, on its device), and ``"every"`` does so on every call: tensor
parallelism needs the same batch on every rank of the group, and a data loader that gives each
rank its own batch would otherwise produce a silently wrong model (each rank's shard of
another batch). The values ride in the same all-reduce (hashed with the description); only
ranks that differ exchange the per-input sums, and the error names each input that differs and
the ranks that agree on it. Ranks given the same floats compute the same sums (the same
reduction over the same bits); a NaN is compared as its text, equal on every rank.

One caller is exempt from the float comparison: torch.distributed.pipelining's shape inference
(``PipelineStage`` without ``input_args``) calls a later stage with uninitialised activations
(``torch.empty_strided``), different on every rank; a call from inside it (found on the Python
stack, :func:`_in_pipeline_shape_inference`) compares integer and boolean inputs only. The real
steps' float inputs of such a stage are the previous stage's outputs, which tensor parallelism
makes the same on every rank of its group, so nothing is lost. A later call of an agreed
description is not compared in ``"new"`` mode.

The same first call (every call in ``"every"``) also checks the ranks' random streams. A
replicated activation must be the same on every rank, so a model that draws random numbers
(dropout, noise, label dropout; a sharded dropout draws the whole mask and keeps its slice)
needs every rank of the group to draw the same ones: the contract is that ranks of a
tensor-parallel group are seeded the same (data-parallel replicas may differ). The check
notes the default generators' states (CPU, and the current CUDA device where CUDA is in use)
before the call; if the call moved them, the ranks compare a digest of the states they drew
from, in one more all-reduce after the forward, and raise :class:`RandomStateError` on every
rank when they differ, naming the fix, instead of returning replicas that match no rank's
unsharded result. A model that draws nothing pays nothing and may be seeded per rank.

A rank whose inputs fail its own checks (:class:`InputError`: a token id out of range, a
sequence beyond the model's limit) still takes part when a check is due, so its peers raise
``InputMismatchError`` naming its error instead of waiting for it. After an
``InputMismatchError`` no collective of the model was issued: the module and the group stay
usable for the next, agreed call.
"""

from __future__ import annotations

import hashlib
import sys

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from tpcompile.compat import new_group
from tpcompile.errors import InputError, InputMismatchError, RandomStateError
from tpcompile.runtime.timeouts import collective_failure, group_timeout

__all__ = ["CallCheck", "MODES", "check_mode", "describe", "generator_states", "side_group",
           "values_digest"]

MODES = ("new", "every")
CACHE_LIMIT = 4096  # agreed descriptions kept; cleared on every rank at the same call
_SIDE: dict[str, tuple] = {}  # group name -> (group, its gloo side group)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"check_calls must be one of {MODES}, got {mode!r}")
    return mode


def side_group(group):
    """The gloo group over ``group``'s ranks that call checks use (one per group, made once).

    Every rank of ``group`` creates it at the same point (``parallelize`` on each rank); ranks
    outside the group need not take part (``use_local_synchronization``).
    """
    cached = _SIDE.get(group.group_name)
    if cached is None or cached[0] is not group:  # a group re-created under the same name
        # gloo beside NCCL too (a CPU int64 pair); a fake group (planning tests) stays fake
        backend = "fake" if dist.get_backend(group) == "fake" else "gloo"
        side = new_group(dist.get_process_group_ranks(group), timeout=group_timeout(group),
                              backend=backend, use_local_synchronization=True, sort_ranks=False,
                              group_desc=f"tpcompile_calls_{group.group_name}")
        cached = _SIDE[group.group_name] = (group, side)
    return cached[1]


def _leaf(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}[{', '.join(map(str, x.shape))}]"
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)[:40]
    return type(x).__name__


def _fingerprint(t: torch.Tensor) -> str:
    if t.device.type == "meta" or t.numel() == 0:
        return "-"
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    both = torch.stack([flat.sum(), (flat * weights).sum()]).tolist()  # one device sync
    return f"{both[0]:.17g}/{both[1]:.17g}"


def values_digest(names: list, flat: list, floats: bool = True) -> tuple[tuple[str, str], ...]:
    """``(input name, fingerprint)`` of each input tensor, from a call's flat inputs and their
    placeholder names: equal on ranks given the same batch. ``floats=False`` leaves floating
    and complex inputs out (a pipeline's shape inference: see the module doc)."""
    return tuple((name, _fingerprint(t)) for name, t in zip(names, flat)
                 if isinstance(t, torch.Tensor)
                 and (floats or not (t.is_floating_point() or t.is_complex())))


# torch.distributed.pipelining's functions that call a stage with uninitialised activations:
# PipelineStage's metadata inference (torch 2.13), and its name before
_SHAPE_INFERENCE = frozenset({"_forward_metadata_inference", "_shape_inference"})
_PIPELINING = "torch/distributed/pipelining/"


def _in_pipeline_shape_inference() -> bool:
    """Whether this call comes from inside torch.distributed.pipelining's shape inference."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _SHAPE_INFERENCE and _PIPELINING in code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def describe(args: tuple, kwargs: dict) -> str:
    """What ranks must agree on about a call: ``(int64[2, 16], mask=bool[2, 16]), grad``."""
    parts = [", ".join(_leaf(x) for x in pytree.tree_leaves(a)) or "()" for a in args]
    parts += [f"{k}={', '.join(_leaf(x) for x in pytree.tree_leaves(v))}" for k, v in kwargs.items()]
    return f"({', '.join(parts)}), {'grad' if torch.is_grad_enabled() else 'no grad'}"


def _digest(text: str) -> int:
    """A positive int64; 0 is reserved for 'this rank refused its inputs'."""
    return (int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2) + 1


class CallCheck:
    """Checks each call of one module: local input checks, then agreement across ranks."""

    def __init__(self, group, mode: str = "new"):
        self.group, self.mode = group, check_mode(mode)
        self.side = side_group(group) if group is not None and dist.get_world_size(group) > 1 else None
        self.agreed: set[str] = set()
        self.calls = 0
        self.backward_ran: bool | None = None  # of the last forward with gradients
        self.random_before: bytes | None = None  # generator states before a checked call

    def track_backward(self, outputs) -> None:
        """After a forward with gradients: note whether its backward reaches the outputs."""
        tensors = [t for t in pytree.tree_leaves(outputs)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.side is None or not tensors or not torch.is_grad_enabled():
            return
        self.backward_ran = False
        torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_reached, mode="any")

    def _backward_reached(self, grad) -> None:
        self.backward_ran = True

    def __call__(self, spec, args: tuple, kwargs: dict) -> None:
        try:
            flat, refusal = spec.check(args, kwargs), None
        except InputError as e:
            flat, refusal = [], e
        if self.side is None:
            if refusal is not None:
                raise refusal
            return
        text = describe(args, kwargs)
        if torch.is_grad_enabled() and self.backward_ran is not None:
            text += ", after a backward" if self.backward_ran else ", after a forward without backward"
        if self.mode == "new" and text in self.agreed:
            if refusal is not None:  # peers with this call skip the check: nothing to tell them
                raise refusal
            return
        if self.mode == "every":
            self.calls += 1
            text = f"call {self.calls}: {text}"
        names = [w and w.name for w in spec.expected]
        self._agree(text, values_digest(names, flat, not _in_pipeline_shape_inference()), refusal)
        self.random_before = generator_states()
        if self.mode == "new":
            if len(self.agreed) >= CACHE_LIMIT:
                self.agreed.clear()
            self.agreed.add(text)

    def check_random(self) -> None:
        """After a checked call: ranks whose call drew random numbers drew the same ones."""
        before, self.random_before = self.random_before, None
        if before is None or generator_states() == before:
            return  # nothing checked, or nothing drawn: every rank ran the same graph
        d = _digest(before.hex())
        both = torch.tensor([d, -d], dtype=torch.int64)
        self._run(lambda: dist.all_reduce(both, dist.ReduceOp.MAX, group=self.side))
        if both[0] != -both[1]:
            raise RandomStateError(
                "ranks drew different random numbers: this call draws from the default "
                "generator (dropout, noise, sampling) and the ranks of the tensor-parallel group "
                "were seeded differently, so replicated activations would match no rank's "
                "unsharded model\n  hint: seed every rank of the group the same "
                "(torch.manual_seed(seed)); data-parallel replicas may differ (seed with the "
                "data-parallel rank, never the tensor-parallel one)")

    def _agree(self, text: str, values: tuple, refusal: InputError | None) -> None:
        d = 0 if refusal is not None else _digest(f"{text}\n{values}")
        both = torch.tensor([d, -d], dtype=torch.int64)
        self._run(lambda: dist.all_reduce(both, dist.ReduceOp.MAX, group=self.side))
        if refusal is None and both[0] == -both[1]:  # max == min == mine: all agree
            return
        mine = (text, None if refusal is None else f"{type(refusal).__name__}: "
                f"{str(refusal).splitlines()[0]}", values)
        every = [None] * dist.get_world_size(self.side)
        self._run(lambda: dist.all_gather_object(every, mine, group=self.side))
        if refusal is not None:
            raise refusal
        raise InputMismatchError(_message(every))

    def _run(self, collective) -> None:
        timeout = group_timeout(self.group)  # the model group's, even if changed since
        if timeout is not None and timeout != group_timeout(self.side):
            dist.distributed_c10d._set_pg_timeout(timeout, self.side)
        try:
            collective()
        except RuntimeError as e:
            raise collective_failure("the call check (an all_reduce)", self.side, e) from e


def generator_states() -> bytes:
    """The default generators' states: the CPU one, and the current CUDA device's where CUDA
    is in use (``torch.random.fork_rng``'s pair)."""
    state = torch.get_rng_state().numpy().tobytes()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state += torch.cuda.get_rng_state().numpy().tobytes()
    return state


def _grouped(keys: list[str], indent: str = "  ") -> str:
    """'  rank 0: a' / '  ranks [1, 2]: b' lines, in the order each key first appears."""
    groups: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    return "\n".join(f"{indent}{'rank' if len(rs) == 1 else 'ranks'} "
                     f"{rs[0] if len(rs) == 1 else rs}: {key}" for key, rs in groups.items())


def _message(every: list[tuple[str, str | None, tuple]]) -> str:
    refused = [(r, why) for r, (_, why, _) in enumerate(every) if why is not None]
    if refused:
        rank, why = refused[0]
        return (f"rank {rank} refused its inputs ({why}); every rank stops here instead of "
                "issuing the model's collectives")
    hint = ("\n  hint: every rank of the tensor-parallel group must make the same calls (none "
            "skipped) with the same inputs (the same batch on every rank; a data-parallel split "
            "goes across groups, not within one)")
    if len({text for text, _, _ in every}) > 1:
        return ("ranks called the module with different inputs (dtypes and shapes, grad mode):\n"
                + _grouped([text for text, _, _ in every]) + hint)
    per_rank = [dict(values) for _, _, values in every]
    differing = [name for name in per_rank[0] if len({v.get(name) for v in per_rank}) > 1]
    return (f"ranks called the module with the same shapes ({every[0][0]}) but different values "
            f"of {', '.join(f'input {name}' for name in differing)} (every input tensor is "
            "compared: token ids, positions, masks, features; per tensor: sum / position-weighted "
            "sum):"
            + "".join(f"\n  input {name}:\n"
                      + _grouped([str(v.get(name)) for v in per_rank], indent="    ")
                      for name in differing) + hint)
