"""``tpcompile advise``'s answer as text: the cost model, one row per configuration, the
advice, whether tensor parallelism pays, and for an MoE model each block's expert cut."""

from __future__ import annotations

from tpcompile.inspect.advise.advise_experts import render_experts
from tpcompile.inspect.explain.explain_text import table
from tpcompile.inspect.explain.plan_svg import human_bytes

__all__ = ["render"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _row(r, best: bool, train: bool) -> tuple:
    sizes = (r.param_bytes, r.buffer_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_bytes,
             r.fsdp_unit_bytes) if train else (r.param_bytes, r.buffer_bytes, r.kv_cache_bytes)
    config = (r.tp, ("FSDP " if r.fsdp else "") + str(r.dp), r.checkpointing,
              "yes" if r.sp else "no") if train else (r.tp, r.dp)
    return (*config, *map(human_bytes, sizes), human_bytes(r.memory_bytes), "yes" if r.fits else "no",
            r.collectives, human_bytes(int(r.tp_sent_bytes)), human_bytes(int(r.dp_sent_bytes)),
            _ms(r.compute_s), _ms(r.tp_comm_s), _ms(r.dp_comm_s),
            _ms(r.step_s) + (" *" if best else ""))


def _verdict(a, capacity: float) -> list[str]:
    """The advice, and a sentence on whether tensor parallelism pays."""
    if a.best is None:
        least = min(a.configs, key=lambda r: r.memory_bytes)
        return [f"no configuration fits in {capacity:.1f} GiB per GPU: the smallest need is "
                f"{human_bytes(least.memory_bytes)} ({least.label()})"]
    r = a.best_config
    lines = [f"advice: {r.label()}: the lowest estimated step time ({_ms(r.step_s)} ms) of the "
             f"{sum(c.fits for c in a.configs)} configurations that fit in {capacity:.1f} GiB "
             "per GPU"]
    pure = [c for c in a.configs if c.fits and c.tp == 1]
    if r.tp == 1 and len({c.tp for c in a.configs}) > 1:
        lines.append(f"tensor parallelism does not pay here: TP 1 ({'FSDP' if r.fsdp else 'DP'} "
                     f"over all {a.gpus} GPUs) is the fastest configuration that fits")
    elif pure:
        p = min(pure, key=lambda c: c.step_s)
        lines.append(f"tensor parallelism pays: the fastest at TP 1 ({p.label()}) is estimated "
                     f"at {_ms(p.step_s)} ms")
    return lines


def render(a) -> str:
    train = not a.cost.inference
    mode = "training" if train else "inference"
    lines = [f"tpcompile advise: {a.model} ({a.dtype}) on {a.gpus} GPUs, {mode}, example inputs "
             f"{', '.join('x'.join(map(str, s)) for s in a.inputs)} per data-parallel rank at TP 1",
             ""]
    lines += ["cost model (estimates, not measurements):"] + [f"  {x}" for x in a.cost.assumptions()]
    config = ("TP", "DP", "ckpt", "SP") if train else ("TP", "DP")
    memory = ("params", "buffers", "grads", "optim", "activ", "FSDP unit") if train \
        else ("params", "buffers", "kv cache")
    header = config + memory + ("total", "fits", "TP colls", "TP sent", "DP sent", "compute ms",
                                "TP comm ms", "DP comm ms", "step ms")
    rows = [_row(r, i == a.best, train) for i, r in enumerate(a.configs)]
    lines += ["", "per rank, per step:"] + table(header, rows)
    capacity = a.cost.device.memory_gib * a.cost.usable_memory
    experts = render_experts(a.experts)
    return "\n".join(lines + [""] + _verdict(a, capacity) + ([""] + experts if experts else []))
