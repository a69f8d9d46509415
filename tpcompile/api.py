"""``tpcompile.parallelize``: capture -> plan -> rewrite -> a module of local shards.

Example (under ``torchrun --nproc-per-node 2``)::

    import torch.distributed as dist, tpcompile
    dist.init_process_group("gloo")            # "nccl" on GPUs
    model = MyTransformer()                    # any nn.Module
    tp = tpcompile.parallelize(model, (tokens,))
    loss = tp(tokens).sum(); loss.backward()   # grads are local shards, outputs replicated
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import fx, nn

from tpcompile.agreement import agree, collective_entries, plan_entries, value_entries
from tpcompile.capture import capture
from tpcompile.errors import MeshError, TPCompileError
from tpcompile.liveness import warn_if_unbounded
from tpcompile.pipeline import Pass, run_passes
from tpcompile.plan import PlanOptions, ShardingPlan
from tpcompile.passes.bias import fuse_bias_pass, split_bias_pass
from tpcompile.passes.insert_collectives import insert_collectives_pass
from tpcompile.passes.localize import localize_pass
from tpcompile.passes.materialize import materialize_params_pass
from tpcompile.passes.mutations import clone_converted_writes_pass
from tpcompile.passes.plan_sharding import plan_sharding
from tpcompile.passes.sequence_linears import fuse_sequence_linears_pass
from tpcompile.runtime import TPModule

__all__ = ["parallelize", "plan_model", "rewrite", "rewrite_passes", "resolve_group"]


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
               dynamic: bool = True, **options):
    """Capture ``model`` and plan it for ``world_size`` ranks; no process group needed.

    ``options``: ``vocab_parallel``, ``loss_parallel`` (see :class:`PlanOptions`).
    ``dynamic=False`` captures at the example's sizes only: the same plan, 2.5x faster on a
    large model, for planning that never runs the graph at other sizes.
    """
    opts = PlanOptions(**options)
    cap = capture(model, example_inputs, example_kwargs, dynamic=dynamic,
                  static_dims=opts.static_dims)
    split_bias_pass(cap.gm)
    return cap, plan_sharding(cap, world_size, opts)


def rewrite_passes(plan: ShardingPlan, rank: int, group_name: str) -> list[Pass]:
    """The transform pipeline for one rank, each pass named so it can be diffed on its own."""
    return [
        ("localize", functools.partial(localize_pass, plan=plan, rank=rank, group=group_name)),
        ("insert_collectives", functools.partial(
            insert_collectives_pass, plan=plan, rank=rank, group=group_name)),
        ("clone_converted_writes", functools.partial(clone_converted_writes_pass, plan=plan)),
        ("materialize_params", functools.partial(materialize_params_pass, plan=plan, rank=rank)),
        ("fuse_bias", fuse_bias_pass),
        ("fuse_sequence_linears", fuse_sequence_linears_pass),
    ]


def rewrite(model: nn.Module, example_inputs, world_size: int, rank: int,
            group_name: str = "tp", record: bool = False, example_kwargs=None, **options):
    """Plan and rewrite one rank's graph without a process group (for inspection and tests).

    Returns ``(gm, plan, records)``; the graph's collectives name ``group_name``.
    """
    cap, plan = plan_model(model, example_inputs, world_size, example_kwargs, **options)
    gm, records = run_passes(cap.gm, rewrite_passes(plan, rank, group_name), record=record)
    return gm, plan, records


def parallelize(model: nn.Module, example_inputs=(), mesh=None, *, example_kwargs=None,
                vocab_parallel: bool = False, loss_parallel: bool = False,
                sequence_parallel: bool = False) -> TPModule:
    """Shard ``model`` Megatron-style over the ranks of ``mesh`` (default: the world group).

    Args:
        model: any ``nn.Module`` torch.export can capture; left untouched (free it if you like).
        example_inputs: a tuple of tensors shaped like a real call (meta tensors work too).
        mesh: a 1-D ``DeviceMesh`` or ``ProcessGroup``; None uses the default process group.
        example_kwargs: keyword inputs of the example call (``attention_mask=...``).
        vocab_parallel: shard token-embedding tables by vocabulary rows (one extra forward
            all-reduce each, (N-1)/N of the table saved per rank).
        loss_parallel: return logits of a column-parallel LM head as this rank's vocabulary
            shard instead of gathering them; compute the loss with
            :func:`tpcompile.sharded_cross_entropy`. A loss traced inside the model (a
            ``forward`` that returns ``F.cross_entropy(...)``) is vocabulary-parallel anyway.
        sequence_parallel: Megatron-SP: norms, residual adds and dropout run on sequence
            shards (dim 1 of ``(batch, seq, features)`` activations); every all-reduce becomes
            a reduce-scatter and an all-gather. The sequence length is fixed to the example's.

    Returns:
        a :class:`TPModule` holding this rank's shards only, with the model's parameter names;
        its outputs are replicated and equal ``model(*inputs)``; other batch sizes and sequence
        lengths than ``example_inputs`` are accepted.
    """
    group, rank, world_size = resolve_group(mesh)
    warn_if_unbounded(group)

    def build():
        cap, plan = plan_model(model, example_inputs, world_size, example_kwargs,
                               vocab_parallel=vocab_parallel, loss_parallel=loss_parallel,
                               sequence_parallel=sequence_parallel)
        entries = plan_entries(cap, plan)  # before the rewrite edits the captured graph
        gm, _ = run_passes(cap.gm, rewrite_passes(plan, rank, group.group_name))
        return (gm, plan), entries + collective_entries(gm)

    # before the model's first collective; raises on every rank
    gm, plan = agree(group, build, values=value_entries(model))
    return TPModule(gm, plan, rank, group)
