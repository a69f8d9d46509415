"""Collectives that end in a clear error, never a silent hang.

tpcompile never changes the process group's timeout (it belongs to the caller); every collective
of a parallelized module waits at most that long. On gloo a rank that exited or crashed makes
its peers fail at their next collective at once ("Connection closed by peer"), and a rank that
is alive but skips a collective makes them fail when the timeout expires. On NCCL the watchdog
aborts a collective that exceeds the timeout. Either way the failure surfaces here, and is
re-raised as a :class:`CollectiveError` that names the collective, the group and the likely
cause. ``parallelize`` warns when the timeout is so long that a lost rank would look like a hang.
"""

from __future__ import annotations

import re
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcompile.errors import CollectiveError

__all__ = ["group_timeout", "collective_failure", "warn_if_unbounded", "LONG_TIMEOUT"]

LONG_TIMEOUT = timedelta(hours=1)


def group_timeout(group) -> timedelta | None:
    """The timeout the group's backends apply to each collective (None if it cannot be read)."""
    try:
        devices = group._device_types or [torch.device("cpu")]
        return max(group._get_backend(d).options._timeout for d in devices)
    except (AttributeError, RuntimeError):  # private API: a backend without readable options
        return None


def _group_by_name(name: str):
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except (AttributeError, RuntimeError, KeyError, ValueError):
        return None


def _cause(err: BaseException) -> str:
    """The backend's message without its source location, e.g. 'Connection closed by peer ...'."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return re.sub(r"^\[[^\]]+\.(cc|cpp|h):\d+\]\s*", "", first)


def collective_failure(what: str, group, err: BaseException) -> CollectiveError:
    """The error to raise when ``what`` (an all_reduce, the plan agreement...) failed on ``group``.

    ``group``: a ProcessGroup or the group name the functional collectives use.
    """
    pg = _group_by_name(group) if isinstance(group, str) else group
    name = group if isinstance(group, str) else getattr(group, "group_name", "?")
    where, bound = "", "the process group's timeout"
    if pg is not None:
        try:
            where = f" on rank {dist.get_rank(pg)} of {dist.get_world_size(pg)}"
        except RuntimeError:  # the group is already torn down
            pass
        timeout = group_timeout(pg)
        if timeout is not None:
            bound = f"the process group's timeout ({timeout.total_seconds():g} s)"
    return CollectiveError(
        f"{what} on process group {name!r} failed{where}: {_cause(err)}\n"
        "  hint: another rank exited, crashed or did not reach this collective; every rank must "
        "run the same forward and backward calls with the same input shapes. Waiting is bounded "
        f"by {bound}; set it with init_process_group(timeout=...) or new_group(timeout=...)")


def warn_if_unbounded(group) -> None:
    """Warn when a rank that dies or skips a collective would block the others for over an hour."""
    timeout = group_timeout(group)
    if timeout is not None and timeout > LONG_TIMEOUT:
        warnings.warn(
            f"tpcompile: the process group's timeout is {timeout}; a rank that exits or skips a "
            "collective would block the others that long before they raise. Pass a shorter "
            "timeout to init_process_group (gloo's default is 30 min, NCCL's 10 min)",
            stacklevel=3)
