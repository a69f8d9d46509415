"""Ranks agree on the plan and the rewritten graph before the model's first collective.

Every rank plans on its own. If two ranks planned differently (other model code, config,
example shapes or options), their graphs would issue different collectives and the job would
hang or train on wrong numbers. So ``parallelize`` ends with one tiny all-gather of a digest of
*entries* that every rank must share:

- the captured graph, one entry per node (its op, arguments and output dtype/shape) and per
  parameter (dtype and shape), plus the example inputs: what the plan was derived from;
- the plan, one entry per parameter, placement, conversion and root, including every rank's
  local shapes;
- the rewritten graph's collectives in order (op and name), which is the sequence every rank
  must issue identically.

The rewritten code itself is not compared: with uneven shards its local shape constants
legitimately differ per rank, and they follow from the entries above. Digests differing, the
ranks exchange their entries against rank 0's to find the first that differs and every rank
raises the same :class:`PlanMismatchError` naming it. A rank whose planning failed still takes
part in the all-gather, so the others raise at once (naming its error) instead of waiting for it.

The same all-gather carries a checksum of the model's weights. Ranks holding different weights
(unseeded initialisation) only get a warning naming the first differing tensor: loading a
checkpoint after ``parallelize`` is a legitimate way to make them equal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
import torch.distributed as dist
from torch import fx, nn

from tpcompile.core.capture import Capture
from tpcompile.runtime.collectives import COLLECTIVE_FNS
from tpcompile.errors import PlanMismatchError
from tpcompile.runtime.timeouts import collective_failure
from tpcompile.core.plan import ShardingPlan

__all__ = ["Entry", "plan_entries", "collective_entries", "value_entries", "digest",
           "first_difference", "mismatch_message", "agreement"]

Entry = tuple[str, str]  # (what, its rank-independent description)
SHOWN = 300  # characters of an entry a mismatch message quotes
# plan sections, causes first: a rank with other options differs in "options" before anything
PLAN_ORDER = ["world_size", "options", "params", "roots", "placements", "conversions",
              "grad_syncs", "outputs", "fallbacks", "replicated"]


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_describe(x) for x in v) + ")"
    return type(v).__name__ if v is not None else "-"


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def plan_entries(cap: Capture, plan: ShardingPlan) -> list[Entry]:
    """The captured graph and the plan as entries."""
    out = [(f"example input {i}", f"{str(dt).removeprefix('torch.')}{list(s)}")
           for i, (s, dt) in enumerate(cap.input_specs)]
    for node in cap.gm.graph.nodes:
        v = _attr(cap.gm, node.target) if node.op == "get_attr" else node.meta.get("val")
        out.append((f"captured node {node.name}", f"{node.format_node()} -> {_describe(v)}"))
    plan_json = json.loads(plan.to_json())
    for section in sorted(plan_json, key=lambda k: (PLAN_ORDER + [k]).index(k)):
        value = plan_json[section]
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
            value, list) else [("", value)]
        for key, item in items:
            out.append((f"plan {section} {key}".rstrip(), json.dumps(item, sort_keys=True)))
    return out


def collective_entries(gm: fx.GraphModule) -> list[Entry]:
    """The collectives one rank's rewritten graph issues, in order."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_FNS]
    return [(f"collective {i}", f"{n.name} = {n.target.__name__}") for i, n in enumerate(calls)]


def digest(entries: list[Entry]) -> str:
    h = hashlib.sha256()
    for what, text in entries:
        h.update(what.encode() + b"\x01" + text.encode() + b"\x00")
    return h.hexdigest()[:16]


def first_difference(mine: list[Entry], reference: list[Entry]) -> tuple[int, str] | None:
    """(index, 'what: text' of mine there) at the first entry that differs, or None."""
    for i in range(max(len(mine), len(reference))):
        a = mine[i] if i < len(mine) else ("(no entry)", "")
        b = reference[i] if i < len(reference) else ("(no entry)", "")
        if a != b:
            return i, f"{a[0]}: {a[1]}"[:SHOWN]
    return None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def first_entry_that_differs(reference: list[Entry], firsts: list[tuple[int, str] | None]) -> str:
    """The earliest differing entry and each rank's value there, the same text on every rank."""
    index = min(f[0] for f in firsts if f is not None)
    ref = reference[index] if index < len(reference) else ("(no entry)", "")
    ref_text = f"{ref[0]}: {ref[1]}"[:SHOWN]
    groups: dict[str, list[int]] = {ref_text: []}
    for rank, f in enumerate(firsts):  # ranks that differ later agree with rank 0 here
        groups.setdefault(f[1] if f is not None and f[0] == index else ref_text, []).append(rank)
    return f"entry {index}:\n" + "\n".join(f"  {_ranks(ranks)}: {text}" for text, ranks in groups.items())


def mismatch_message(reference: list[Entry], firsts: list[tuple[int, str] | None]) -> str:
    return ("ranks planned differently; the first entry that differs (of the captured graph, the "
            f"plan and the rewritten graph's collectives) is {first_entry_that_differs(reference, firsts)}"
            "\n  hint: every rank must call parallelize with the same model code, config, "
            "example input shapes and options")


def value_entries(model: nn.Module) -> list[Entry]:
    """A checksum of every parameter and buffer holding data (meta tensors have none)."""
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        for part, plain in _plain_parts(name, t.detach()):
            if plain.device.type != "meta" and not plain.is_complex():
                out.append((f"values of {part}", f"sum {float(plain.sum(dtype=torch.float64)):.17g}"))
    return out


def _plain_parts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``t``, or the plain tensors a tensor subclass holds (torchao's quantized weights
    implement few ops; their parts are what the ranks must agree on)."""
    if not is_traceable_wrapper_subclass(t):
        return [(name, t)]
    inner, _ = t.__tensor_flatten__()
    return [p for attr in inner for p in _plain_parts(f"{name}.{attr}", getattr(t, attr))]


def _gather(obj, group, what: str) -> list:
    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        raise collective_failure(what, group, e) from e
    return out


def _compare_to_rank0(entries: list[Entry], group) -> tuple[list[Entry], list]:
    """Called by every rank once digests differ: rank 0's entries, and where each rank differs."""
    reference = [entries]
    try:
        dist.broadcast_object_list(reference, group_src=0, group=group)
    except RuntimeError as e:
        raise collective_failure("plan agreement", group, e) from e
    return reference[0], _gather(first_difference(entries, reference[0]), group, "plan agreement")


@contextlib.contextmanager
def agreement(group, values: list[Entry] = ()):
    """Every rank runs the ``with`` body (which appends its entries), then all ranks agree.

    Raises on every rank: the rank's own error if its body failed, a
    :class:`PlanMismatchError` naming the failed rank or the first differing entry otherwise.
    ``values`` (checksums of the model's weights) only warn when they differ: ranks may load
    their weights after parallelize, but if they do not, each would keep a different model.
    """
    entries: list[Entry] = []
    try:
        yield entries
    except Exception as e:  # reported to the other ranks, then re-raised here
        text = str(e).strip()
        _gather(("failed", f"{type(e).__name__}: {text.splitlines()[0][:SHOWN]}" if text
                 else type(e).__name__, ""), group, "plan agreement")
        raise
    statuses = _gather(("ok", digest(entries), digest(values)), group, "plan agreement")
    failed = [(r, s[1]) for r, s in enumerate(statuses) if s[0] == "failed"]
    if failed:
        rank, why = failed[0]
        raise PlanMismatchError(
            f"rank {rank} could not parallelize the model ({why}); every rank stops here instead "
            f"of waiting for it" + (f" (ranks {[r for r, _ in failed]} failed)" if len(failed) > 1 else ""))
    if len({s[1] for s in statuses}) > 1:
        raise PlanMismatchError(mismatch_message(*_compare_to_rank0(entries, group)))
    if len({s[2] for s in statuses}) > 1:
        warnings.warn(
            "tpcompile: ranks hold different weights; the first that differs is "
            f"{first_entry_that_differs(*_compare_to_rank0(list(values), group))}\n  each rank "
            "keeps its shard of its own weights: seed every rank alike, or load a checkpoint "
            "after parallelize (tpcompile.load_full_state_dict, tpcompile.state.checkpoint.load)",
            stacklevel=3)
