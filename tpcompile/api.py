"""``tpcompile.parallelize``: capture -> plan -> rewrite -> a module of local shards.

Example (under ``torchrun --nproc-per-node 2``)::

    import torch.distributed as dist, tpcompile
    dist.init_process_group("gloo")            # "nccl" on GPUs
    model = MyTransformer()                    # any nn.Module
    tp = tpcompile.parallelize(model, (tokens,))
    loss = tp(tokens).sum(); loss.backward()   # grads are local shards, outputs replicated
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from tpcompile.core.placement import Shard
from tpcompile.core.plan import PlanOptions
from tpcompile.core.subclass_weights import meta_like
from tpcompile.errors import MeshError, PlanError
from tpcompile.passes import pipeline
from tpcompile.passes.planner.unapplied_options import announce, unapplied_checkpointing
from tpcompile.passes.rewrite.checkpoint_regions import MODES
from tpcompile.runtime.agreement import agreement, collective_entries, plan_entries, value_entries
from tpcompile.runtime.calls import check_mode, describe
from tpcompile.runtime.module import TPModule
from tpcompile.runtime.signatures import bind_constants, plain_tensors, written_buffers
from tpcompile.runtime.timeouts import warn_if_unbounded

__all__ = ["parallelize", "plan_model", "rewrite", "resolve_group"]


def resolve_group(mesh=None):
    """(group, rank, world_size) for a 1-D DeviceMesh, a ProcessGroup, or the default group."""
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise MeshError(
                "no process group: call torch.distributed.init_process_group first (torchrun "
                "sets the environment), or pass mesh=init_device_mesh(device, (world_size,))")
        group = dist.group.WORLD
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    elif hasattr(mesh, "get_group"):
        if mesh.ndim != 1:
            raise MeshError(
                f"tpcompile shards over one mesh dimension; got a {mesh.ndim}-D mesh "
                f"{tuple(mesh.shape)}; pass the tensor-parallel sub-mesh, e.g. mesh['tp']")
        group = mesh.get_group()
    else:
        raise MeshError(f"mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    return group, dist.get_rank(group), dist.get_world_size(group)


def plan_model(model: nn.Module, example_inputs, world_size: int, example_kwargs=None, *,
               dynamic: bool = True, reuse_blocks: bool = True, **options) -> tuple:
    """Capture ``model`` and plan it for ``world_size`` ranks; no process group needed.

    Returns ``(cap, plan)``: the planned capture (``cap.gm`` is the graph the plan names) and
    the :class:`ShardingPlan`. ``options``: ``vocab_parallel``, ``loss_parallel``,
    ``sequence_parallel``, ``experts``, ``chain_cost`` (see :class:`PlanOptions`).
    ``dynamic=False`` captures at the example's sizes only: the same plan, 2.5x faster on a
    large model, for planning that never runs the graph at other sizes. ``reuse_blocks``
    (default) exports three of the model's identical blocks and repeats one
    (:mod:`tpcompile.core.stamp`): the same plan, faster; False exports every block.
    """
    planned = pipeline.plan(model, example_inputs, world_size, example_kwargs,
                            options=PlanOptions(**options), dynamic=dynamic,
                            reuse_blocks=reuse_blocks)
    return planned.cap, planned.plan


def rewrite(model: nn.Module, example_inputs, world_size: int, rank: int,
            group_name: str = "tp", record: bool = False, example_kwargs=None, **options):
    """Plan and rewrite one rank's graph without a process group (for inspection and tests).

    Returns ``(gm, plan, records)``; the graph's collectives name ``group_name``.
    """
    planned = pipeline.plan(model, example_inputs, world_size, example_kwargs,
                            options=PlanOptions(**options))
    gm, records = pipeline.rewrite(planned, rank, group_name, record=record)
    return gm, planned.plan, records


def parallelize(model: nn.Module, example_inputs=(), mesh=None, *, example_kwargs=None,
                vocab_parallel: bool = False, loss_parallel: bool = False,
                sequence_parallel: bool = False, check_calls: str = "new",
                reuse_blocks: bool = True, activation_checkpointing: str | None = None,
                experts: str = "tensor", chain_cost: str = "cuda") -> TPModule:
    """Shard ``model`` Megatron-style over the ranks of ``mesh`` (default: the world group).

    Args:
        model: any ``nn.Module`` torch.export can capture; left untouched (free it if you like).
        example_inputs: a tuple of tensors shaped like a real call (meta tensors work too).
        mesh: a 1-D ``DeviceMesh`` or ``ProcessGroup``; None uses the default process group.
        example_kwargs: keyword inputs of the example call (``attention_mask=...``).
        vocab_parallel: cut the vocabulary: token-embedding tables by rows (one extra forward
            all-reduce each) and the LM head (a weight with as many rows as a table, tied or
            not) column-parallel, its logits all-gathered where the model returns them
            (``loss_parallel`` keeps them sharded); (N-1)/N of each saved per rank.
        loss_parallel: return logits of a column-parallel LM head as this rank's vocabulary
            shard instead of gathering them; compute the loss with
            :func:`tpcompile.sharded_cross_entropy`. A loss traced inside the model (a
            ``forward`` that returns ``F.cross_entropy(...)``) is vocabulary-parallel anyway.
        sequence_parallel: Megatron-SP: norms, residual adds and dropout run on sequence
            shards (dim 1 of ``(batch, seq, features)`` activations); every all-reduce becomes
            a reduce-scatter and an all-gather. The sequence length is fixed to the example's.
        check_calls: when the ranks compare a call's inputs (shapes, dtypes, the values of
            every input tensor) before its collectives: ``"new"`` the first call with
            each new signature, ``"every"`` every call (which also names a rank that skipped a
            call or a backward). See docs/guarantees.md.
        reuse_blocks: capture three of the model's identical blocks with torch.export and
            repeat one's graph for the others (the default): the same graph and plan, in a
            planning time that hardly grows with depth (a whole capture when blocks differ,
            the plan's notes say why); False exports every block.
        activation_checkpointing: None keeps the model's own ``torch.utils.checkpoint``
            regions (and Hugging Face's ``gradient_checkpointing_enable()``) checkpointed, on
            the shards; ``"full"`` checkpoints each repeated block (``layers.0``, ...) of a
            model that does not; ``"selective"`` too, but saves the outputs of its matmuls,
            attentions and collectives and recomputes the rest. A region that cannot be
            kept is named in a warning.
        experts: how stacked ``(experts, out, in)`` expert weights are cut: ``"tensor"`` (each
            expert column -> row), ``"expert"`` (whole experts per rank, one all-reduce per MoE
            block) or ``"auto"`` (per block, the smaller share); see docs/parallelism.md.
        chain_cost: the device (``"cuda"``, ``"cpu"``) whose constants price chains that run
            on one row per sample (a timestep embedder, an adaLN modulation), kept whole where
            their all-reduces cost more than they save, or ``"off"`` to shard every chain; see
            docs/parallelism.md.

    Returns:
        a :class:`TPModule` holding this rank's shards only, with the model's parameter names;
        its outputs are replicated and equal ``model(*inputs)``; other batch sizes and sequence
        lengths than ``example_inputs`` are accepted. A model with a static KV cache (buffers
        written in place) gets it sharded, and a one-token decode call its own capture; a
        Hugging Face causal LM gets ``tp.generate`` (see docs/generation.md).
    """
    if activation_checkpointing not in MODES:
        raise ValueError(f"activation_checkpointing must be one of {MODES}, got "
                         f"{activation_checkpointing!r}")
    group, rank, _ = resolve_group(mesh)
    check_mode(check_calls)  # before planning, which takes a while
    warn_if_unbounded(group)
    options = PlanOptions(vocab_parallel=vocab_parallel, loss_parallel=loss_parallel,
                          sequence_parallel=sequence_parallel, experts=experts,
                          chain_cost=chain_cost)
    planned, gm = _agreed_rank_graph(model, example_inputs, example_kwargs, group, options,
                                     reuse_blocks)
    kept, dropped = _checkpoint_regions(gm, activation_checkpointing)
    unapplied = unapplied_checkpointing(activation_checkpointing, kept, dropped)
    plan = announce(planned.plan, unapplied)
    skeleton = (_skeleton(model, plan, rank, group)
                if written_buffers(gm) or callable(getattr(model, "generate", None)) else None)
    return TPModule(gm, plan, rank, group, check_calls, checkpointed_regions=tuple(kept),
                    skeleton_capture=skeleton,  # other call signatures (decode) captured anew
                    capture_signature=skeleton if written_buffers(gm) else None,
                    reused_blocks=planned.cap.reused)


def _agreed_rank_graph(model: nn.Module, example_inputs, example_kwargs, group,
                       options: PlanOptions, reuse_blocks: bool):
    """Plan ``model`` and rewrite this rank's graph; returns ``(planned, graph)``. The ranks
    agree on what they planned (its values, plan and collectives) before the model's first
    collective: a difference raises on every rank."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    with agreement(group, values=value_entries(model)) as entries:
        planned = pipeline.plan(model, example_inputs, world_size, example_kwargs,
                                options=options, reuse_blocks=reuse_blocks)
        gm, _ = pipeline.rewrite(planned, rank, group.group_name)
        entries += plan_entries(planned.cap, planned.plan) + collective_entries(gm)
    return planned, gm


def _skeleton(model: nn.Module, plan, rank: int, group) -> SignatureCapture | None:
    """A :class:`SignatureCapture` of ``model`` for its :class:`TPModule`: a static KV cache
    (prefill and decode calls are two captures), or a Hugging Face model whose ``generate()``
    captures a static-cache wrapper around it. Training works without it, so a model it
    cannot copy gets a warning saying what is lost, and None."""
    try:
        return SignatureCapture(model, plan, rank, group.group_name)
    except Exception as e:  # noqa: BLE001 - said in the warning
        warnings.warn(f"tpcompile: cannot keep a meta copy of {type(model).__name__} "
                      f"({type(e).__name__}: {e}); the module runs the captured call "
                      "signature only (no decode captures, no generate)", stacklevel=3)
        return None


def _checkpoint_regions(gm, mode: str | None) -> tuple[list, list]:
    """Run the graph's checkpointed regions through torch.utils.checkpoint (the pipeline's
    outline passes, in place; returns the names of the regions kept and the ``(name, why)``
    of those dropped); warn for each region that stays inline (its activations are saved). A
    mode that finds no repeated block is said by the caller, with the other options that did
    nothing (``unapplied_checkpointing``)."""
    _, records = pipeline.outline(gm, mode)
    kept, dropped = next(r.facts for r in records if r.name == "checkpoint_regions")
    for name, reason in dropped:
        warnings.warn(f"tpcompile: {name} is not checkpointed in the parallelized model: "
                      f"{reason}; its activations are saved for backward", stacklevel=3)
    return kept, dropped


class SignatureCapture:
    """``(args, kwargs) -> graph``: plan and rewrite the model for another call signature.

    It keeps a copy of the model on the meta device (:attr:`skeleton`, no weights: the graph is
    bound to the module's own tensors afterwards), so the caller may still free the model.
    ``module`` (built around the skeleton, holding it as ``prefix``) is captured instead: a
    wrapper that owns a static KV cache. Every tensor the first plan holds must be placed as
    that plan places it (checked: the graphs share the tensors). A call returns the new graph
    and its own plan (the wrapper's cache buffers are allocated from it); ``device``: where the
    graph will run, when the call's inputs do not say (meta examples).
    """

    def __init__(self, model: nn.Module, plan, rank: int, group_name: str):
        # plain tensor attributes (a mask cache) are meta in the copy too, their values kept
        # apart for each new graph (runtime.signatures.bind_constants)
        self.constants = {name: t.detach().clone() for name, t in plain_tensors(model).items()}
        memo = {id(t): meta_like(t) for t in list(model.parameters()) + list(model.buffers())
                + list(plain_tensors(model).values())}
        self.skeleton = copy.deepcopy(model, memo)
        self.device = next(model.parameters(), torch.empty(0)).device
        self.plan, self.rank, self.group_name = plan, rank, group_name

    def __call__(self, args: tuple, kwargs: dict, module: nn.Module | None = None,
                 prefix: str = "", device: torch.device | None = None):
        meta = tuple(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a
                     for a in args)
        with warnings.catch_warnings():  # "accepts only 1 there": what this capture is for
            warnings.simplefilter("ignore")
            planned = pipeline.plan(self.skeleton if module is None else module, meta,
                                    self.plan.world_size, kwargs or None, options=self.plan.options)
        for name, entry in self.plan.params.items():
            other = planned.plan.params.get(prefix + name)
            if other is not None and _cut(planned.plan, other) != _cut(self.plan, entry):
                raise PlanError(
                    f"the call {describe(args, kwargs)} plans {name} as {other.placement}, the "
                    f"module's first call as {entry.placement}: one module cannot serve both")
        # captured on the skeleton: its device constants go to ``device``, else where the
        # call's inputs are (a model built on meta and loaded since runs there, not where
        # parallelize saw it)
        device = device or next((a.device for a in pytree.tree_leaves((args, kwargs))
                                 if isinstance(a, torch.Tensor) and a.device.type != "meta"),
                                self.device)
        gm, _ = pipeline.rewrite(planned, self.rank, self.group_name, skip=("materialize_params",),
                                 device=device)
        bind_constants(gm, self.constants, device, prefix)
        return gm, planned.plan


def _cut(plan, entry):
    """Which slice of a tensor each rank holds (root names differ between captures).

    A tensor every rank holds whole is one cut however the plan spells it (``R``, or a shard
    of a root kept whole: a kv projection with fewer kv heads than ranks)."""
    if all(tuple(s) == tuple(entry.global_shape) for s in entry.local_shapes):
        return "whole"
    p = entry.placement
    ranges = plan.specs.ranges(p.layout) if isinstance(p, Shard) else None
    return type(p).__name__, getattr(p, "dim", None), entry.local_shapes, ranges
