"""Every sharding rule, checked against torch's own OpInfo samples (issue 16, part 2).

For each OpInfo whose ATen op has a rule in ``RULES`` (plus a few OpInfos that only reach a
ruled overload through a decomposition), each sample (CPU, small, at most ``MAX_SAMPLES``) is
traced with ``make_fx`` twice: pre-dispatch (the ops ``torch.export`` keeps: ``linear``,
``matmul``, ``softmax.int``) and post-dispatch (their decompositions: ``t``, ``mm``,
``_softmax``). Every traced node whose overload has a rule becomes a one-op graph, and every
placement of its tensor inputs (Replicate, Partial for floating inputs and max / min partials
too, Shard on each dim) is propagated. Where the rule *accepts* the placements (an output
placement, no conversion of any input: the op runs on each rank's pieces as they are), the op
is localized for each rank (the rule's ``localize``), run on that rank's pieces and compared
with the op on whole tensors:

- a Shard output must equal that rank's slice of the whole output,
- a Partial output, reduced over ranks (summed; by max / min for a max / min partial), must
  equal the whole output,
- a Replicate output must equal the whole output.

World sizes 2 and 3 (3 cuts most dims unevenly, and dims shorter than the world size give
overlapping, replicated blocks). Shards of one size are cut alike, so ops whose operands are
sharded on the same label (``add``, ``bmm``) meet aligned shards. A rule that disagrees fails,
naming the op, the node, the input shapes and the placements.

    pytest tests/unit/test_rule_soundness.py -q -s      # prints the case counts
"""

from __future__ import annotations

import copy
import itertools
import operator
import random
import warnings
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from tpcompile.core.placement import Layout, Partial, Replicate, Shard, each
from tpcompile.core.plan import ShardingPlan
from tpcompile.core.shards import take_shard
from tpcompile.passes.planner.dims import val
from tpcompile.passes.planner.propagate import Constraints, propagate
from tpcompile.passes.planner.rules import RULES, rule_for, rule_for_target
from tpcompile.passes.rewrite.localize import localize_pass

common = pytest.importorskip("torch.testing._internal.common_methods_invocations",
                             reason="OpInfo needs torch's test extras (expecttest)")
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

aten = torch.ops.aten
WORLD_SIZES = (2, 3)
MAX_SAMPLES = 8        # per OpInfo
MAX_PLACEMENTS = 48    # input placement combinations per (node, world size); sampled beyond
# measured on torch 2.13 (CPU): the floor keeps coverage from dropping silently
FLOOR = {2: 2400, 3: 2400}   # 2575 and 2635 checked
MIN_OVERLOADS = 200          # of the ruled overloads (pointwise tags included) samples reach

# OpInfos that reach a ruled overload only through another name or a decomposition
EXTRA_OPINFOS = {"T", "square", "__getitem__", "nn.functional.softmin", "nn.functional.selu",
                 "nn.functional.relu6", "mT", "broadcast_to", "expand_as", "true_divide",
                 "__radd__", "__rmul__", "__rpow__", "__rdiv__", "float", "int", "bool",
                 "nn.functional.normalize", "nn.functional.l1_loss", "nn.functional.tanhshrink"}
SKIP_PREFIXES = ("masked.", "sparse.", "_refs.")
# values that no two runs agree on: only shapes and dtypes are compared
UNINITIALIZED = {aten.empty_like.default}



def _random_sdpa(node: fx.Node) -> bool:
    """SDPA with attention dropout: sharded, it draws from a per-rank generator (by design,
    tpcompile.runtime.rng), so no value can match the whole op's; shapes are compared."""
    if node.target is not aten.scaled_dot_product_attention.default:
        return False
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return bool(p)


# Known unsound cases: name -> (predicate on (node, input placements), reason). Each is
# checked to still fail by test_known_unsound (strict xfail), so a fix shows up. Empty:
# dropout with p=1 (sharded, it divided its mask by 1 - p = 0) is checked with the rest and by
# test_dropout_p1_is_exact.
KNOWN: dict = {}


@dataclass
class Case:
    opinfo: str
    gm: fx.GraphModule        # placeholders -> the one op -> output
    node: str                 # the op's node name
    inputs: list              # full input tensors, one per placeholder
    desc: str


def _opinfos():
    wanted = {getattr(t, "overloadpacket", None) for t in RULES} - {None}
    names = {p.__name__ for p in wanted}
    for o in common.op_db:
        if o.name.startswith(SKIP_PREFIXES):
            continue
        aten_name = o.aten_name or o.name
        packet = getattr(torch.ops.aten, aten_name, None)
        tagged = packet is not None and "default" in packet.overloads() and rule_for_target(
            packet.default) is not None  # ops ruled by their pointwise tag
        if aten_name in names or o.name.split(".")[-1] in names or o.name in EXTRA_OPINFOS or tagged:
            yield o


def _dtype(o):
    for dt in (torch.float32, torch.int64, torch.bool):
        if dt in o.supported_dtypes("cpu"):
            return dt
    return None


def _label(o):
    return o.name + (f".{o.variant_test_name}" if o.variant_test_name else "")


class _Recorder(fx.Interpreter):
    """Runs a traced graph, keeping a copy of every value (in-place ops mutate their inputs)."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=False)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        return out


def _one_op_graph(node: fx.Node, values: dict) -> tuple[fx.GraphModule, str, list] | None:
    """``node`` alone: a placeholder per tensor input, the op, its output."""
    inputs = list(dict.fromkeys(node.all_input_nodes))
    if any(not isinstance(values.get(a), torch.Tensor) for a in inputs):
        return None  # a list-valued input (getitem of a split): not a one-op case
    out_val = val(node)
    if not (isinstance(out_val, torch.Tensor) or (isinstance(out_val, (list, tuple)) and out_val
                                                 and all(isinstance(v, torch.Tensor) for v in out_val))):
        return None
    g = fx.Graph()
    env = {}
    for i, a in enumerate(inputs):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = val(a) if isinstance(val(a), torch.Tensor) else values[a]
        env[a] = p
    op = g.node_copy(node, lambda a: env[a])
    op.meta["val"] = out_val
    g.output(op)
    return fx.GraphModule(torch.nn.Module(), g), op.name, [values[a].clone() for a in inputs]


def _key(node: fx.Node) -> str:
    def sig(a):
        if isinstance(a, fx.Node):
            v = val(a)
            return (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else "node"
        return a
    return repr((str(node.target), tree_map(sig, (node.args, node.kwargs))))


def _cases():
    """Every distinct ruled node the OpInfo samples trace to."""
    with warnings.catch_warnings():  # deprecations and dtype notes from the samples' ops
        warnings.simplefilter("ignore")
        return _collect()


def _collect():
    seen, out, per_op = set(), [], defaultdict(set)
    torch.manual_seed(0)
    for o in _opinfos():
        dtype = _dtype(o)
        if dtype is None:
            continue
        try:
            gen = o.sample_inputs("cpu", dtype)
            samples = list(itertools.islice(gen, MAX_SAMPLES))
            getattr(gen, "close", lambda: None)()  # not later, inside a trace, by the GC
        except Exception:  # noqa: BLE001 - an OpInfo whose samples cannot be built here
            continue
        variants = [o.op] + ([o.inplace_variant] if o.inplace_variant is not None else [])
        for sample, fn, pre in itertools.product(samples, variants, (True, False)):
            leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
            where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            if not where or any(leaves[i].numel() > 4096 for i in where):
                continue

            def call(*ts, fn=fn, leaves=leaves, where=where, spec=spec, inplace=fn is not o.op):
                flat = list(leaves)
                for i, t in zip(where, ts):
                    flat[i] = t
                x, args, kwargs = tree_unflatten(flat, spec)
                if inplace:
                    x = x.clone()
                return fn(x, *args, **kwargs)

            tensors = [leaves[i].clone() for i in where]
            try:
                gm = make_fx(call, pre_dispatch=pre)(*tensors)
                rec = _Recorder(gm)
                torch.manual_seed(0)
                rec.run(*[t.clone() for t in tensors])
            except Exception:  # noqa: BLE001 - samples make_fx cannot trace (data-dependent)
                continue
            for n in gm.graph.nodes:
                if rule_for(n) is None or n.target is operator.getitem:
                    continue  # getitem only selects a split's output: checked with the split
                k = _key(n)
                if k in seen:
                    continue
                seen.add(k)
                built = _one_op_graph(n, rec.values)
                if built is None:
                    continue
                one, name, inputs = built
                shapes = [tuple(t.shape) for t in inputs]
                desc = f"{_label(o)}: {n.format_node()} inputs {shapes}"
                out.append(Case(_label(o), one, name, inputs, desc))
                per_op[n.target].add(_label(o))
    return out, per_op


def _reads_extrema(case: Case) -> bool:
    """Whether max / min partial inputs are tried: on the ``extremal`` rules, which read them
    as they are, and on ``add`` for every other rule (``OpView.placement`` reduces an extremum
    before any rule that is not extremal sees it: one code path, one op proves it)."""
    node = next(n for n in case.gm.graph.nodes if n.name == case.node)
    return node.target is torch.ops.aten.add.Tensor or rule_for(node).extremal


def _choices(t: torch.Tensor, name: str, extrema: bool):
    yield Replicate()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        yield Partial()
    if t.dtype.is_floating_point and extrema:  # a max / min over a cut dim (rules/extrema.py)
        yield from (Partial("max"), Partial("min"))
    for d, size in enumerate(t.shape):
        if size > 1:  # a size-1 dim is a broadcast dim to the rules, never a shard
            yield Shard(d, Layout(f"{name}.{size}", size))


def _combos(case: Case, ws: int):
    names = [n.name for n in case.gm.graph.nodes if n.op == "placeholder"]
    per_input, extrema = [], _reads_extrema(case)
    for name, t in zip(names, case.inputs):
        # shards of the same size share a root name (so ops meet aligned shards): per size
        per_input.append([p if not isinstance(p, Shard) else Shard(p.dim, Layout(
            f"size{p.layout.size}", p.layout.size)) for p in _choices(t, name, extrema)])
    combos = [c for c in itertools.product(*per_input) if any(
        not isinstance(p, Replicate) for p in c)]
    if len(combos) > MAX_PLACEMENTS:
        rng = random.Random(zlib.crc32(case.desc.encode()) + ws)
        combos = rng.sample(combos, MAX_PLACEMENTS)
    return [dict(zip(names, c)) for c in combos]


def _accepted(case: Case, ws: int, inputs: dict):
    """The propagation of ``inputs`` if the rule runs the op on them as they are, else None."""
    constraints = Constraints(frozenset(), inputs=inputs)
    for _ in range(8):  # demands (whole heads, chunk-aligned cuts) re-cut the roots, as the planner does
        state = propagate(case.gm, ws, constraints)
        fresh = [d for d in state.demands if d not in constraints.demands]
        if not fresh:
            break
        constraints.demands.extend(fresh)
    node = next(n for n in state.placements if n.name == case.node)
    if state.placements[node] is None or node.name in state.fallbacks or any(
            user is node for _, user in state.conversions):
        return None
    return state


def _pieces(t: torch.Tensor, p, specs, ws: int, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Partial) and p.reduce != "sum":  # one rank holds the extremum
        sign = 1 if p.reduce == "max" else -1
        below = [t - sign * torch.rand(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
                 for _ in range(ws - 1)]
        return below[:1] + [t.clone()] + below[1:]
    if isinstance(p, Partial):
        parts = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
                 for _ in range(ws - 1)]
        return parts + [t - sum(parts)] if parts else [t.clone()]
    return [take_shard(t, p, specs, r) for r in range(ws)]


def _run(gm, inputs):
    torch.manual_seed(0)  # dropout draws the same mask as the whole tensor's (tpcompile.runtime.rng)
    return gm(*[x.clone() for x in inputs])


def _close(actual, expected, partial: bool, what: str):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.dtype.is_floating_point or expected.dtype.is_complex:
        tol = 1e-4 if partial else 1e-5
        if expected.dtype in (torch.float16, torch.bfloat16):
            tol = 2e-2 if not partial else 1e-1
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _check(case: Case, ws: int, inputs: dict, state) -> None:
    specs = state.specs
    plan = ShardingPlan(world_size=ws, params={}, conversions=(), grad_syncs={},
                        placements={n.name: p for n, p in state.placements.items() if p is not None},
                        roots=dict(specs.roots))
    out_p = each(plan.placements[case.node])
    gen = torch.Generator().manual_seed(zlib.crc32(case.desc.encode()))
    full_out = each(_run(case.gm, case.inputs))
    pieces = [_pieces(t, state.placements[n], specs, ws, gen)
              for n, t in zip((n for n in state.placements if n.op == "placeholder"), case.inputs)]
    shown = {n: str(p) + (f"[{p.layout.size}]" if isinstance(p, Shard) else "") for n, p in inputs.items()}
    what = f"{case.desc} placements {shown} -> {[str(p) for p in out_p]} ws={ws}"
    node = _node(case)
    target = node.target
    local_outs = []
    for r in range(ws):
        gm = fx.GraphModule(torch.nn.Module(), _copy_graph(case.gm.graph))
        localize_pass(gm, plan, r, "tp")
        gm.recompile()
        local_outs.append(each(_run(gm, [pc[r] for pc in pieces])))
    for i, (p, full) in enumerate(zip(out_p, full_out)):
        mine = [lo[i] for lo in local_outs]
        if target in UNINITIALIZED or _random_sdpa(node):
            full = torch.zeros_like(full)
            mine = [torch.zeros_like(m) for m in mine]
        if isinstance(p, Partial):
            combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[p.reduce]
            total = mine[0].clone()
            for m in mine[1:]:
                total = combine(total, m)
            _close(total, full, True, f"{what}: output {i} reduced over ranks by {p.reduce}")
        else:
            for r, m in enumerate(mine):
                expected = take_shard(full, p, specs, r) if isinstance(p, Shard) else full
                _close(m, expected, False, f"{what}: output {i} on rank {r}")


def _node(case: Case) -> fx.Node:
    return next(n for n in case.gm.graph.nodes if n.name == case.node)


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    return copy.deepcopy(graph)  # node names are kept: the plan is keyed by them


@pytest.fixture(scope="module")
def cases():
    return _cases()


def _known(case: Case, inputs: dict) -> str | None:
    return next((k for k, (hit, _) in KNOWN.items() if hit(_node(case), inputs)), None)


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: CI time
def test_rules_agree_with_whole_tensor_ops(cases, ws):
    all_cases, _ = cases
    counted, failures, by_op, known = 0, [], Counter(), Counter()
    for case in all_cases:
        for inputs in _combos(case, ws):
            try:
                state = _accepted(case, ws, inputs)
            except Exception as e:  # noqa: BLE001 - a propagation crash is a failure too
                failures.append(f"{case.desc} placements {inputs}: propagate raised {e!r}")
                continue
            if state is None:
                continue
            if (k := _known(case, inputs)) is not None:
                known[k] += 1
                continue
            counted += 1
            by_op[str(_node(case).target)] += 1
            try:
                _check(case, ws, inputs, state)
            except Exception as e:  # noqa: BLE001 - collected, reported together
                failures.append(f"{case.desc} placements {inputs}: {type(e).__name__}: {e}"[:1500])
    print(f"\nws={ws}: {counted} (op, sample, placement) cases checked over {len(all_cases)} "
          f"one-op graphs, {len(by_op)} overloads; known unsound, skipped: {dict(known)}")
    for op, n in sorted(by_op.items()):
        print(f"  {op}: {n}")
    print("  registered, never accepted a distributed input here:",
          sorted(str(t) for t in RULES if str(t) not in by_op))
    assert not failures, f"{len(failures)} unsound cases:\n" + "\n\n".join(failures[:30])
    assert counted >= FLOOR[ws], f"coverage dropped: {counted} < {FLOOR[ws]} cases"
    assert len(by_op) >= MIN_OVERLOADS, f"coverage dropped: {len(by_op)} < {MIN_OVERLOADS} overloads"


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_unsound(cases, name):
    """Each known unsound case still disagrees (then xfails with its reason); once it agrees,
    this fails so that it leaves KNOWN and joins the checked cases."""
    hit, why = KNOWN[name]
    seen, failed = 0, 0
    for ws in WORLD_SIZES:
        for case in cases[0]:
            for inputs in _combos(case, ws):
                if not hit(_node(case), inputs) or (state := _accepted(case, ws, inputs)) is None:
                    continue
                seen += 1
                try:
                    _check(case, ws, inputs, state)
                except AssertionError:
                    failed += 1
    assert seen, f"no OpInfo sample reaches known case {name}: remove it from KNOWN"
    assert failed, f"known case {name} agrees now ({seen} cases): remove it from KNOWN"
    pytest.xfail(f"{failed}/{seen} cases: {why}")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_dropout_p1_is_exact(ws):
    """Dropout with p=1 gives zeros and zero gradients on every rank's slice, sharded (unevenly
    at ws 3) or replicated, as the unsharded op does, and draws nothing: the generator stays
    in step with the unsharded model's (a later dropout's mask still matches)."""
    from tpcompile.runtime.rng import sharded_dropout
    size, per = 5, -(-5 // ws)
    ranges = [[(min(r * per, size), min((r + 1) * per, size))] for r in range(ws)]
    x = torch.randn(3, size, dtype=torch.float64)
    x[0, 0] = float("inf")  # x * 0, as aten.dropout computes it: NaN here, on both sides
    torch.manual_seed(0)
    whole = x.clone().requires_grad_()
    expected = torch.nn.functional.dropout(whole, 1.0, True)
    expected.sum().backward()
    after = torch.get_rng_state()
    assert not expected[1:].any() and whole.grad.eq(0).all()
    for r in range(ws):
        (s, e), = ranges[r]
        for name, fn in (("sharded", lambda t: sharded_dropout(t, 1.0, True, 1, size, ranges[r])),
                         ("replicated", lambda t: aten.dropout(t, 1.0, True))):
            full = name == "replicated"
            mine = (x if full else x[:, s:e]).clone().requires_grad_()
            torch.manual_seed(0)
            out = fn(mine)
            out.sum().backward()
            want, grad = (expected, whole.grad) if full else (expected[:, s:e], whole.grad[:, s:e])
            torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True,
                                       msg=f"{name} rank {r}: forward")
            torch.testing.assert_close(mine.grad, grad, rtol=0, atol=0, msg=f"{name} rank {r}: grad")
            assert torch.equal(torch.get_rng_state(), after), f"{name} rank {r}: drew numbers"
