"""Errors users can act on. Internal invariants use ``assert``; anything a user can fix is one of these."""

from __future__ import annotations

__all__ = ["TPCompileError", "CaptureError", "PlanMismatchError", "MeshError"]


class TPCompileError(ValueError):
    """Base class: the message names what went wrong, where, and the way out."""


class CaptureError(TPCompileError):
    """torch.export could not capture the model (data-dependent control flow, unsupported input)."""


class MeshError(TPCompileError):
    """No process group, a mesh that is not 1-D, or ranks that disagree on the world."""


class PlanMismatchError(TPCompileError):
    """Ranks computed different plans: running them would deadlock or give wrong numbers."""
