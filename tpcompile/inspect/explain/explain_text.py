"""The readable form of an explain report: ``str(report)``.

Sections in the order a reader checks them: what each parameter became and why, what goes over
the wire and when, the memory it buys, what fell back, how far from Megatron's minimum it is,
and what PyTorch's own ``parallelize_module`` could express.
"""

from __future__ import annotations

from tpcompile.inspect.traffic import bound_verdict

__all__ = ["render", "table"]


def table(header: tuple[str, ...], rows: list[tuple], indent: str = "  ") -> list[str]:
    """Left-aligned columns under a dashed rule; the last column is not padded."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for i, r in enumerate(cells):
        lines.append(indent + "  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())
        if i == 0:
            lines.append(indent + "  ".join("-" * w for w in width))
    return lines


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _why(name: str, p, chains: dict) -> str:
    sync = " (gradient all-reduced)" if p.grad_sync else ""
    if p.chain:
        extra = f"; {p.reason}" if p.style == "replicate" else ""
        return f"chain {p.chain}: {chains[p.chain]['summary']}{extra}{sync}"
    return p.reason + sync


def _params(r) -> list[str]:
    rows = []
    for name, p in sorted(r.params.items()):
        if p.aliases and name != p.aliases[0] and p.aliases[0] in r.params:
            continue  # a tied weight: shown once, under its first name
        label = " = ".join(p.aliases) if len(p.aliases) > 1 else name
        rows.append((label, p.style, "-" if p.dim is None else p.dim,
                     f"{_shape(p.global_shape)} -> {_shape(p.local_shape)}",
                     _why(name, p, r.chains)))
    return [f"parameters (local shapes on rank {r.rank})"] + table(
        ("parameter", "style", "dim", "global -> local", "why"), rows)


def _experts(r) -> list[str]:
    """One line per MoE block: whole experts per rank, or each expert split (and why)."""
    if not r.experts:
        return []
    lines = ["experts (options.experts: how each MoE block's stacked experts are cut)"]
    for module, how in sorted(r.experts.items()):
        lines.append(f"  {module}: {how}")
        load = r.expert_load.get(module)
        if isinstance(load, str):
            lines.append(f"    load: {load}")
        elif load:
            mean = sum(load) / len(load)
            lines.append(f"    load: rows of the example routed to each rank's whole experts: "
                         f"{', '.join(map(str, load))} (busiest {max(load) / mean:.2f}x the mean)"
                         if mean else "    load: no rows routed")
    return lines


def _collectives(r) -> list[str]:
    lines = ["collectives per training step (bytes: the whole tensor reduced or gathered)"]
    if not r.collectives:
        return lines + ["  none"]
    rows = [(c.phase, c.op, _shape(c.shape), c.dtype, f"{c.bytes:,}" if c.bytes is not None else "?",
             f"{c.node} ({c.module or 'top level'})",
             c.inserted_as + (" (recomputed)" if c.recomputed else "")) for c in r.collectives]
    lines += table(("phase", "op", "shape", "dtype", "bytes", "after node (module)", "inserted as"),
                   rows)
    for phase, counts in r.collective_counts().items():
        total = sum(c.bytes or 0 for c in r.collectives if c.phase == phase)
        kinds = ", ".join(f"{n} x {op}" for op, n in sorted(counts.items())) or "none"
        lines.append(f"  per {phase}: {kinds} ({total:,} bytes)")
    return lines


def _param_bytes(r) -> list[str]:
    per_rank, total = r.param_bytes_per_rank, r.param_bytes_total
    share = f"({max(per_rank) / total:.0%})" if total else ""
    if len(set(per_rank)) == 1:
        return [f"parameter bytes per rank: {per_rank[0]:,} of {total:,} unsharded {share}"]
    return [f"parameter bytes per rank: {min(per_rank):,} to {max(per_rank):,} of {total:,} "
            f"unsharded {share}: " + ", ".join(f"rank {i} {b:,}" for i, b in enumerate(per_rank))]


def _located(title: str, items: list[dict]) -> list[str]:
    if not items:
        return [f"{title}: none"]
    lines = [f"{title}:"]
    for i in items:
        lines.append(f"  {i['node']} ({i['module'] or 'top level'}): {i['reason']}")
        if i.get("source"):
            lines.append(f"    at {i['source']}")
    return lines


def _checkpointing(regions: dict) -> list[str]:
    """Regions recomputed in backward, and those kept inline (their activations saved)."""
    if not regions["kept"] and not regions["dropped"]:
        return []  # no section: the model checkpoints nothing
    lines = [f"activation checkpointing: {len(regions['kept'])} region(s) recomputed in "
             "backward"]
    lines += [f"  not checkpointed: {d['region']}: {d['reason']}" for d in regions["dropped"]]
    return lines


def _megatron(r) -> list[str]:
    lines = ["Megatron lower bound per repeated block, derived from the model (docs/explain.md): "
             "1 all-reduce forward per group of summed row-parallel matmuls, 1 backward per "
             "group of column-parallel inputs whose gradients meet (groups ready together: one)"]
    rows, tot = [], [0] * 6
    for m in r.megatron:
        vals = (m.bound_forward, m.bound_backward, m.bound_bytes, m.forward, m.backward, m.bytes)
        tot = [a + b for a, b in zip(tot, vals)]
        rows.append((m.layer or "(outside layers)", len(m.chains), f"{vals[0]}/{vals[1]}",
                     f"{vals[2]:,}", f"{vals[3]}/{vals[4]}", f"{vals[5]:,}"))
    rows.append(("total", sum(len(m.chains) for m in r.megatron), f"{tot[0]}/{tot[1]}",
                 f"{tot[2]:,}", f"{tot[3]}/{tot[4]}", f"{tot[5]:,}"))
    lines += table(("layer", "chains", "bound fwd/bwd", "bound bytes", "tpcompile fwd/bwd",
                    "tpcompile bytes"), rows)
    return lines + [f"  -> {bound_verdict(r.megatron)}"]


def _dtensor(r) -> list[str]:
    lines = [f"parallelize_module equivalent (report.to_dtensor_plan()): {len(r.dtensor_plan)} "
             f"module(s); {len(r.not_expressible)} not expressible"]
    by_reason: dict[str, list[str]] = {}
    for module, why in r.not_expressible.items():
        by_reason.setdefault(why, []).append(module)
    for why, modules in by_reason.items():
        lines.append(f"  {_grouped(modules)}: {why}")
    return lines


def _grouped(modules: list[str]) -> str:
    """['a.b.wq', 'a.b.wk'] -> 'a.b.{wq, wk}'."""
    owners = {m.rpartition(".")[0] for m in modules}
    if len(modules) < 2 or len(owners) != 1 or not next(iter(owners)):
        return ", ".join(modules)
    return f"{owners.pop()}.{{{', '.join(m.rpartition('.')[2] for m in modules)}}}"


def _notes(r) -> list[str]:
    """What capture changed about the call, and each option that did nothing, with why."""
    return [f"note: {n}" for n in r.notes]


def render(r) -> str:
    inputs = ", ".join(f"{i['dtype']}[{_shape(i['shape'])}]" for i in r.inputs)
    sections = [
        [f"tpcompile explain: {r.model} on {r.world_size} ranks, example inputs {inputs}"],
        _params(r), _experts(r), _collectives(r), _param_bytes(r),
        _located("fallbacks (gathered before an op without a sharding rule)", r.fallbacks),
        _located("kept replicated", r.kept_replicated),
        _megatron(r), _dtensor(r), _checkpointing(r.checkpointing), _notes(r),
    ]
    return "\n\n".join("\n".join(s) for s in sections if s)
