"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), reloadable at any world size.

DCP stores each tensor under its *global* shape as a set of chunks (offsets + sizes) and, on
load, reads whatever overlap each requested chunk has with the stored ones: that is how it
reshards. It learns a tensor's chunks through the ``_Checkpointable`` protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), which DTensor
implements for its one-chunk-per-rank layouts. tpcompile's layouts are richer (several ranges per
rank, ranges held by several ranks), so :class:`ShardedParam` implements the protocol directly:
each :class:`~tpcompile.core.shards.Piece` of the rank's shard is one chunk. A rank *writes* only the
pieces it owns (each global index is written once, as DCP's validation requires) and *reads*
all the pieces it holds. Replicated tensors stay plain tensors, which DCP deduplicates.

The checkpoint is an ordinary DCP checkpoint of the unsharded model: it loads into a
tensor-parallel module at another world size, into the plain model (``dcp.load(model.
state_dict(), ...)``), or converts to a ``torch.save`` file
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tpcompile.errors import TPCompileError
from tpcompile.runtime.module import TPModule
from tpcompile.state.chunks import Chunk, held_chunks, local_of

__all__ = ["ShardedParam", "sharded_state_dict", "sharded_optimizer_state_dict", "save", "load"]

OPTIMIZER_KEY = "optimizer"  # the optimizer's subtree in a checkpoint; the model's keys stay flat


class ShardedParam(torch.Tensor):
    """A rank's shard presented to DCP as the global tensor it is part of.

    It has the global shape and no data of its own: DCP only asks it for chunks (see
    :mod:`tpcompile.state.chunks`: tensor-parallel pieces, cut again by FSDP2's rows when the
    model is also fully sharded) and for views of the rank's memory, which it writes from or
    reads into in place. ``source`` is the tensor it describes (the local shard, or FSDP2's
    ``DTensor``). Any other tensor operation on it is an error.
    """

    source: torch.Tensor
    chunks: tuple[Chunk, ...]

    @staticmethod
    def __new__(cls, source: torch.Tensor, global_shape, chunks):
        if source.device.type == "meta":
            raise TPCompileError(
                "cannot checkpoint meta shards: allocate them first (tpcompile.state.meta_init.to_empty)")
        local = local_of(source)
        self = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(global_shape), dtype=local.dtype, device=local.device)
        self.source, self.chunks = source, tuple(chunks)
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TPCompileError(
            f"ShardedParam only describes a shard to torch.distributed.checkpoint; {func} is not "
            "supported on it (use tp.state_dict() for the local tensors)")

    def __repr__(self) -> str:
        return f"ShardedParam(global={tuple(self.shape)}, chunks={[c.sizes for c in self.chunks]})"

    @staticmethod
    def _meta(chunk: Chunk) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))

    # ---- the _Checkpointable protocol -------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(local_of(self.source))
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._meta(c), properties=props, size=self.shape))
                for c in self.chunks if c.owned]  # a chunk held by several ranks: its owner writes it

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._meta(c) for c in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for chunk in self.chunks:
            if index.offset is not None and tuple(index.offset) == chunk.offsets:
                return chunk.view
        raise TPCompileError(f"{index.fqn}: this rank holds no chunk at {index.offset}")


def _wrapper(tp: TPModule):
    """name, local tensor -> what DCP should see: a ShardedParam for sharded tensors."""
    def wrap(name: str, value: torch.Tensor) -> torch.Tensor:
        held = held_chunks(tp.plan, name, value, tp.rank)
        return value if held is None else ShardedParam(value, *held)

    return wrap


def sharded_state_dict(tp: TPModule) -> dict[str, torch.Tensor]:
    """``tp.state_dict()`` with each sharded tensor wrapped for DCP (the data is shared).

    Pass it to ``dcp.save`` / ``dcp.load`` directly or inside a larger dict (optimizer state,
    step counters). Loading writes into ``tp``'s parameters in place.
    """
    wrap = _wrapper(tp)
    return {name: wrap(name, local) for name, local in tp.state_dict().items()}


def sharded_optimizer_state_dict(tp: TPModule, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter FQN, per-parameter tensors wrapped for DCP.

    Built by ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (which also
    creates the state of a fresh optimizer, so that it can be loaded into). A state tensor
    shaped like its sharded parameter (Adam's moments) is sharded like it; scalars such as
    ``step`` are replicated.
    """
    wrap = _wrapper(tp)
    osd = get_optimizer_state_dict(tp, optimizer)
    local_shapes = {n: p.shape for n, p in tp.named_parameters()}
    osd["state"] = {  # new dicts: under FSDP2 the ones returned are the optimizer's own
        name: {key: wrap(name, value) if isinstance(value, torch.Tensor)
               and value.shape == local_shapes[name] else value for key, value in state.items()}
        for name, state in osd["state"].items()}
    return osd


def _unwrapped(tree):
    if isinstance(tree, ShardedParam):
        return tree.source
    if isinstance(tree, dict):
        return {k: _unwrapped(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unwrapped(v) for v in tree]
    return tree


def _tree(tp: TPModule, optimizer) -> dict:
    tree = sharded_state_dict(tp)
    if optimizer is not None:
        clash = [k for k in tree if k == OPTIMIZER_KEY or k.startswith(OPTIMIZER_KEY + ".")]
        if clash:
            raise TPCompileError(
                f"the model's tensors {clash} would collide with the optimizer's subtree "
                f"{OPTIMIZER_KEY!r} in the checkpoint; save the optimizer with dcp under a key of "
                "your own (checkpoint.sharded_optimizer_state_dict)")
        tree[OPTIMIZER_KEY] = sharded_optimizer_state_dict(tp, optimizer)
    return tree


def _group(tp: TPModule):
    """DCP's group: the tensor-parallel group, or every rank once FSDP2 also shards ``tp``
    (a 2-D mesh covering the default group; pass ``process_group=`` for another)."""
    return None if any(isinstance(p, DTensor) for p in tp.parameters()) else tp.group


def save(tp: TPModule, checkpoint_id, optimizer: torch.optim.Optimizer | None = None, **kwargs):
    """``dcp.save`` of ``tp``'s shards (and ``optimizer``'s state) over its ranks.

    Call on every rank. The model's tensors are stored under their own FQNs, so the checkpoint
    also loads into the unsharded model with ``dcp.load(model.state_dict(), ...)``.
    """
    kwargs.setdefault("process_group", _group(tp))
    return dcp.save(_tree(tp, optimizer), checkpoint_id=checkpoint_id, **kwargs)


def load(tp: TPModule, checkpoint_id, optimizer: torch.optim.Optimizer | None = None, **kwargs) -> None:
    """``dcp.load`` into ``tp``'s shards (and ``optimizer``), from any world size or unsharded."""
    tree = _tree(tp, optimizer)
    kwargs.setdefault("process_group", _group(tp))
    dcp.load(tree, checkpoint_id=checkpoint_id, **kwargs)
    if optimizer is not None:
        set_optimizer_state_dict(tp, optimizer, _unwrapped(tree[OPTIMIZER_KEY]))
