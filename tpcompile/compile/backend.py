"""``torch.compile(model, backend="tpcompile")``: tensor parallelism with no call to tpcompile.

The backend is registered through the ``torch_dynamo_backends`` entry point, so the string works
after ``pip install`` without importing tpcompile; ``tpcompile.backend(mesh=..., overlap=...)``
returns a configured instance. Inside an initialised process group::

    model = MyTransformer()
    step = torch.compile(model, backend="tpcompile")
    step(tokens)                              # 1st call: plan, shard, swap in the TP forward
    opt = torch.optim.AdamW(model.parameters())   # build the optimizer after that first call

Design. Dynamo hands a backend a torch-level graph whose parameters are *inputs*, and a backend
cannot resize the tensors it receives (Dynamo checks its guards against them right after the
backend returns). So, on the first graph of a module's ``forward``:

1. The module is planned and rewritten by :func:`tpcompile.parallelize`, on torch.export's ATen
   capture of the same module called with this call's inputs: one planner, one rule table.
2. The backend returns a one-shot function. When Dynamo runs it, it installs the rank's shards
   in the module (new ``nn.Parameter`` objects under the same names, so ``state_dict()`` keys
   and ``parameters()`` are the model's, at the sharded size; the full tensors are released)
   and makes the rewritten graph the module's ``forward``. It then runs Dynamo's graph on the
   shards all-gathered with autograd (their backward keeps each rank's slice of the whole
   gradient), so this first call is exact and its gradients land on the shards.
3. Later calls fail Dynamo's parameter guards (the shapes changed) and Dynamo retraces the
   module, whose forward is now the rewritten graph: collectives and local shape constants
   included. The backend sees a :class:`TPModule` frame and hands the graph to inductor with
   :func:`tpcompile.compile_options`. This second call is idempotent by construction. The
   TPModule's repeated blocks are compiled blocks (``tp.compiled_blocks``), compiled
   once, with the inductor option they need (``compile_options(compiled_blocks=True)``).

Retracing the *user's* forward with local shards instead (and patching that graph) fails as
soon as the model hard-codes a global size: the built-in Llama's ``view(B, T, n_heads, hd)``
raises "shape '[2, 8, 4, 8]' is invalid for input of size 256" in Dynamo's fake-tensor trace.

Fallbacks (recorded, never wrong): a forward that Dynamo splits across graphs (a graph break,
e.g. a Python ``if`` on a tensor's value), that torch.export cannot capture, that takes
non-tensor arguments other than their defaults, that runs without a process group, or whose
plan shards nothing runs replicated: its graphs go to inductor unchanged.
:attr:`TPCompileBackend.report` says which and why (``explain()`` prints it).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from tpcompile.api import parallelize
from tpcompile.runtime.collectives import all_gather
from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.compile.frames import CallLayout, current_code, frame_call, frame_name, where
from tpcompile.compile.inductor import compile_options, calls_compiled_blocks
from tpcompile.core.placement import Shard
from tpcompile.core.plan import ShardingPlan
from tpcompile.core.capture import set_tensor
from tpcompile.core.shards import gather_args
from tpcompile.runtime.module import TPModule

__all__ = ["TPCompileBackend", "ModuleReport", "backend", "parallelized", "tpcompile_backend"]

_TP_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its TPModule
_RETIRED = WeakIdKeyDictionary()  # full Parameter replaced by a shard -> its name
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers already checked for retired params
_optimizer_hook = None


@dataclass(frozen=True)
class ModuleReport:
    """What the backend did with one module's forward, and why."""

    module: str
    parallelized: bool
    reason: str
    plan: ShardingPlan | None = None

    def __str__(self) -> str:
        head = "tensor-parallel" if self.parallelized else "replicated"
        return f"{self.module}: {head}: {self.reason}"


def parallelized(model: nn.Module) -> TPModule | None:
    """The :class:`TPModule` the backend swapped into ``model`` (its plan, ``full_state_dict``)."""
    return _TP_OF.get(model)


class TPCompileBackend:
    """A ``torch.compile`` backend: plans, shards and rewrites each module it compiles.

    Args:
        mesh: 1-D ``DeviceMesh`` or ``ProcessGroup``; None uses the default process group.
        overlap: communication/computation overlap (:func:`tpcompile.compile_options`).
        inductor_options: further inductor config, as ``torch.compile(options=...)``.
    """

    def __init__(self, mesh=None, overlap: bool | None = None, **inductor_options):
        self.mesh, self.overlap, self.inductor_options = mesh, overlap, inductor_options
        self.report: list[ModuleReport] = []
        self._decided: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._frames: set[str] = set()  # frames reported by _not_a_module

    def explain(self) -> str:
        return "\n".join(str(r) for r in self.report) or "no module compiled yet"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        root, frame_args = frame_call()
        if root is None:
            if current_code() is not _Arranged.__call__.__code__:  # not a module sharded here
                self._not_a_module(frame_name())
        elif not isinstance(root, TPModule) and root not in self._decided:
            report, first_call = self._decide(gm, example_inputs, root, frame_args)
            self._decided[root] = report
            self._record(report)
            if first_call is not None:
                return first_call
        return self._inductor(gm, example_inputs)

    def _record(self, report: ModuleReport) -> None:
        """Keep ``report``; one that shards nothing also warns: never a silent pass-through."""
        self.report.append(report)
        if not report.parallelized:
            warnings.warn(f"tpcompile backend: {report}", TPCompileWarning, stacklevel=3)

    def _not_a_module(self, frame: str | None) -> None:
        """A graph of a frame that is no module's ``forward`` (a compiled function, or code
        reached through one) runs unchanged: said once per frame."""
        if frame is None or frame in self._frames:
            return
        self._frames.add(frame)
        self._record(ModuleReport(frame, False, (
            "not a module's forward, so it runs replicated (unsharded); the backend shards the "
            "module it is given: torch.compile(model, backend='tpcompile')")))

    def _inductor(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        blocks = calls_compiled_blocks(gm)  # a TPModule's repeated blocks (compile.md): a workaround
        patches = {**compile_options(self.overlap, compiled_blocks=blocks), **self.inductor_options}
        return compile_fx(gm, example_inputs, config_patches=patches)

    def _decide(self, gm, example_inputs, root: nn.Module, frame_args):
        name = type(root).__name__
        why = gm.compile_subgraph_reason
        if why.graph_break:
            return ModuleReport(name, False, (
                f"Dynamo split {name}.forward at {where(why.user_stack)} ({why.reason.strip()}); "
                "a column -> row chain cannot span graphs, so the whole forward runs replicated "
                "(exact); remove the graph break to shard it")), None
        try:  # no process group is a MeshError: compiled as it is, and reported
            with _outside_dynamo():
                args, kwargs, layout = frame_args()
                tp = parallelize(root, args, self.mesh, example_kwargs=kwargs or None)
        except TPCompileError as e:
            return ModuleReport(name, False, f"not parallelized: {e}"), None
        if all(p.style == "replicate" for p in tp.plan.params.values()):
            return ModuleReport(name, False, "the plan shards no weight", tp.plan), None
        renamed = sorted(set(_tensors(root)) - set(_tensors(tp)))
        if renamed:  # a tensor subclass (torchao's) becomes plain tensors under other names
            return ModuleReport(name, False, (
                f"{renamed[0]} is stored under other names once sharded (a tensor subclass "
                "weight), and the backend swaps shards in by name; call tpcompile.parallelize("
                "model, inputs) and torch.compile the result"), tp.plan), None
        tp.compiled_blocks = True  # repeated blocks compile once; _inductor adds the workaround
        report = ModuleReport(name, True, "sharded on the first call; forward is the rewritten "
                              "graph (tpcompile.parallelized(model) returns it)", tp.plan)
        return report, _FirstCall(gm, example_inputs, root, tp, layout)


def backend(mesh=None, overlap: bool | None = None, **inductor_options) -> TPCompileBackend:
    """A configured backend: ``torch.compile(model, backend=tpcompile.backend(mesh=mesh))``."""
    return TPCompileBackend(mesh, overlap, **inductor_options)


# what backend="tpcompile" resolves to (pyproject: [project.entry-points.torch_dynamo_backends])
tpcompile_backend = TPCompileBackend()


class _FirstCall:
    """The call that compiled ``root``: install its shards, then run Dynamo's graph on them whole."""

    def __init__(self, gm, example_inputs, root: nn.Module, tp: TPModule, layout: CallLayout):
        names = {id(t): n for n, t in _tensors(root).items()}
        self.gm, self.root, self.tp, self.local, self.layout = gm, root, tp, _tensors(tp), layout
        self.slots = [names.get(id(x)) if isinstance(x, torch.Tensor) else None
                      for x in example_inputs]

    def __call__(self, *args):
        if parallelized(self.root) is not self.tp:
            _install(self.root, self.tp, self.layout)
        return self.gm(*[a if n is None else self._whole(n) for a, n in zip(args, self.slots)])

    def _whole(self, fqn: str) -> torch.Tensor:
        tp, local = self.tp, self.local[fqn]
        placement = tp._placement(fqn)
        if not isinstance(placement, Shard):
            return local
        ws = tp.plan.world_size
        width, index, mine, _ = gather_args(tp.plan.specs, placement.layout, tp.rank, ws)
        # keep=None: every rank holding an index gets its whole gradient (replicated copies)
        return all_gather(local, placement.dim, width, index, mine, None, ws, tp.group.group_name)


@contextlib.contextmanager
def _outside_dynamo():
    """Export's own tracing, apart from Dynamo's: with Dynamo's tracing context current, the
    shape guards export makes (named after ``forward``'s parameters) join the frame's guards,
    and fail on a decorated forward, whose frame has ``args`` / ``kwargs`` instead."""
    from torch._guards import compile_context, tracing

    with compile_context(None), tracing(None):
        yield


class _Arranged:
    """``root.forward`` once sharded: the TPModule, called as at capture (export's call spec
    is strict about positional and keyword; users are not)."""

    def __init__(self, tp: TPModule, layout: CallLayout):
        self.tp, self.layout = tp, layout

    def __call__(self, *args, **kwargs):
        args, kwargs = self.layout.arrange(args, kwargs)
        return self.tp(*args, **kwargs)


def _install(root: nn.Module, tp: TPModule, layout: CallLayout) -> None:
    """Put ``tp``'s tensors under ``root``'s names and make its graph ``root.forward``."""
    mine = _tensors(tp)
    for fqn, old in _tensors(root).items():
        if fqn in mine:
            set_tensor(root, fqn, mine[fqn])
            if isinstance(old, nn.Parameter):
                _RETIRED[old] = fqn
    root.forward = _Arranged(tp, layout)
    _TP_OF[root] = tp
    _refuse_stale_optimizers()


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by each of its names (tied ones included)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def _refuse_stale_optimizers() -> None:
    """An optimizer built before the first call would step the released full tensors: refuse."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _RETIRED.get(p)
            if name is not None:
                raise TPCompileError(
                    f"this optimizer holds '{name}' as it was before the tpcompile backend "
                    "replaced it by this rank's shard on the model's first compiled call; "
                    "build the optimizer after that call (model.parameters() are the shards)")
    _CHECKED.add(optimizer)
