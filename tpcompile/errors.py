"""Errors users can act on. Internal invariants use ``assert``; anything a user can fix is one of these."""

from __future__ import annotations

__all__ = ["TPCompileError", "CaptureError", "PlanMismatchError", "MeshError", "PlanError",
           "InputError", "InputMismatchError", "RandomStateError", "CollectiveError",
           "TPCompileWarning"]


class TPCompileError(ValueError):
    """Base class: the message names what went wrong, where, and the way out."""


class CaptureError(TPCompileError):
    """torch.export could not capture the model (data-dependent control flow, unsupported input)."""


class MeshError(TPCompileError):
    """No process group, a mesh that is not 1-D, or ranks that disagree on the world."""


class PlanMismatchError(TPCompileError):
    """Ranks computed different plans: running them would deadlock or give wrong numbers."""


class PlanError(TPCompileError):
    """The model was captured, but sharding it as written would compute something else."""


class InputError(TPCompileError):
    """A call's inputs do not fit what was captured (rank, dtype, fixed sizes, token ids)."""


class InputMismatchError(TPCompileError):
    """Ranks called a parallelized module with different inputs (shapes, dtypes, grad mode or
    call count), or one rank refused its inputs: raised on every rank instead of issuing
    collectives that would pair mismatched buffers (an abort on gloo, a hang or garbage on NCCL).
    """


class RandomStateError(InputMismatchError):
    """Ranks of the group drew different random numbers (seeded differently) in a call that
    draws: seed every rank of a tensor-parallel group the same."""


class CollectiveError(TPCompileError, RuntimeError):
    """A collective failed or timed out: another rank exited, crashed or skipped it.

    Also a ``RuntimeError``, the type torch raises for the same failure.
    """


class TPCompileWarning(UserWarning):
    """Something ran unsharded or an option did not apply: exact, but not what was asked for.

    Escalate it with ``warnings.simplefilter("error", TPCompileWarning)``.
    """
