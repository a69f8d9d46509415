"""Full (unsharded) state dicts in and out of a tensor-parallel module.

``tp.state_dict()`` / ``tp.load_state_dict()`` hold this rank's shards under the model's own
names; they round-trip a run on the same world size. The functions here cross to the full
model's state dict:

* :meth:`TPModule.full_state_dict` reassembles every tensor (a collective), on every rank or on one;
* :func:`load_full_state_dict` copies this rank's slices of a full state dict into its shards.
  It never needs the full model in memory: from a safetensors file it reads only the slices
  this rank holds (``safe_open(...).get_slice``), one tensor at a time, so a rank's peak is
  its shards plus one slice. On a model built on the meta device it allocates the shards first
  (see :mod:`tpcompile.state.meta_init`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from tpcompile.errors import TPCompileError
from tpcompile.state.hf_checkpoint import INDEX, HFShardedSource
from tpcompile.state.meta_init import has_meta, to_empty
from tpcompile.runtime.module import TPModule
from tpcompile.core.shards import shard_pieces

__all__ = ["load_full_state_dict", "IncompatibleKeys"]


class IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class _DictSource:
    """A full state dict already in memory."""

    def __init__(self, state_dict):
        self.tensors = state_dict

    def keys(self):
        return self.tensors.keys()

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)


class _SafetensorsSource:
    """One ``.safetensors`` file, or every one in a directory; read lazily, slice by slice."""

    def __init__(self, path):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise TPCompileError(
                "reading safetensors needs the optional dependency: pip install 'tpcompile[io]'") from e
        self.safe_open = safe_open
        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise TPCompileError(f"no safetensors file at {path}")
        self.where, self.shapes = {}, {}
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    self.where[name] = f
                    self.shapes[name] = tuple(st.get_slice(name).get_shape())

    def keys(self):
        return self.where.keys()

    def shape(self, name):
        return self.shapes[name]

    def read(self, name, dim=None, start=0, stop=None):
        # one open per tensor: the mapping (and the pages it touched) is released right after
        with self.safe_open(self.where[name], framework="pt") as st:
            if dim is None:
                return st.get_tensor(name)
            index = (slice(None),) * dim + (slice(start, stop),)
            return st.get_slice(name)[index]


def _source(source):
    if isinstance(source, HFShardedSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        if (Path(source) / INDEX).is_file():  # a save_pretrained directory: index + shards
            return HFShardedSource(source)
        return _SafetensorsSource(source)
    if isinstance(source, dict):
        return _DictSource(source)
    raise TPCompileError(
        f"load_full_state_dict takes a state dict or a safetensors path, got {type(source).__name__}")


def load_full_state_dict(tp: TPModule, source, strict: bool = True, device="cpu",
                         buffers: dict[str, torch.Tensor] | None = None) -> IncompatibleKeys:
    """Copy this rank's slices of the full state dict ``source`` into ``tp``'s shards.

    Args:
        source: a full state dict (name -> tensor, e.g. ``model.state_dict()``), the path of
            a ``.safetensors`` file or of a directory of them (needs ``tpcompile[io]``), or a
            Hugging Face ``save_pretrained`` directory (``model.safetensors.index.json`` and
            its shard files), from which only this rank's slices are read
            (:mod:`tpcompile.state.hf_checkpoint`).
        strict: raise when ``tp`` has a tensor the source lacks or the source has extra keys;
            otherwise both are returned.
        device, buffers: used when ``tp`` was built on the meta device, see
            :func:`tpcompile.state.meta_init.to_empty`.

    Values are copied (and cast to the shards' dtype); no collective is involved. Tied
    parameters are read once, under whichever of their names the source has.
    """
    src = _source(source)
    if has_meta(tp):
        to_empty(tp, device, buffers)
    targets = tp.state_dict(keep_vars=True)
    present = set(src.keys())
    done: dict[int, str] = {}
    missing = []
    with torch.no_grad():
        for name, local in targets.items():
            if id(local) in done:
                continue
            entry = tp.plan.by_fqn.get(name)
            names, shape = (entry.aliases, entry.global_shape) if entry else ((name,), local.shape)
            found = next((a for a in names if a in present), None)
            if found is None:
                missing.append(name)
                continue
            if tuple(src.shape(found)) != tuple(shape):
                raise TPCompileError(
                    f"size mismatch for {name}: the source has {tuple(src.shape(found))} under "
                    f"{found!r}, the model {tuple(shape)}")
            _copy_slices(src, found, local, entry.placement if entry else None, tp)
            done[id(local)] = found
    unexpected = sorted(present - set(targets) - set(done.values()))
    if strict and (missing or unexpected):
        raise TPCompileError(
            f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}; "
            "pass strict=False to load the rest")
    return IncompatibleKeys(missing, unexpected)


def _copy_slices(src, name: str, local: torch.Tensor, placement, tp: TPModule) -> None:
    """This rank's pieces of ``name`` into ``local``: read straight into the shard where the
    source can (a checkpoint directory, the shard in the stored dtype), else read and copied."""
    pieces = shard_pieces(tp.plan, placement, tp.rank)
    reads = [(None, 0, None, local)] if pieces is None else [
        (placement.dim, p.start, p.stop, p.of_local(local, placement.dim)) for p in pieces]
    direct = getattr(src, "read_into", None)
    for dim, start, stop, into in reads:
        if direct is None or not direct(name, dim, start, stop, into):
            into.copy_(src.read(name, dim, start, stop))
