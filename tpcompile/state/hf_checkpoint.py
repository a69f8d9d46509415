"""Read this rank's slices from a Hugging Face checkpoint directory, and nothing else.

A model saved with ``save_pretrained`` is a directory holding ``config.json``,
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file) and several
``model-0000k-of-0000n.safetensors`` files. A safetensors file is an 8-byte header length, a
JSON header (per tensor: dtype, shape, byte offsets) and the row-major data.

:class:`HFShardedSource` opens a shard file only when the rank asks for a tensor in it, reads
its header once, and then reads exactly the bytes of each requested slice with ``os.pread``:
one contiguous range for a slice along dim 0, one range per leading index otherwise. Nothing
is memory-mapped, so the bytes a rank reads are the bytes it asked for, countable in
``/proc/self/io`` (the tests bound them by the rank's shard sizes).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from pathlib import Path

import torch

from tpcompile.errors import TPCompileError

__all__ = ["HFShardedSource", "INDEX"]

INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _Header:
    """One shard file's tensor table; the file stays closed between reads."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb", buffering=0) as f:  # unbuffered: read the header, no more
            size = int.from_bytes(f.read(8), "little")
            table = json.loads(f.read(size))
        table.pop("__metadata__", None)
        self.base, self.table = 8 + size, table

    def _info(self, name: str) -> tuple[torch.dtype, list[int], int]:
        info = self.table[name]
        if info["dtype"] not in _DTYPES:
            raise TPCompileError(f"{self.path.name}: {name} has dtype {info['dtype']}, not readable")
        return _DTYPES[info["dtype"]], list(info["shape"]), self.base + info["data_offsets"][0]

    def tensor(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        dtype, shape, _ = self._info(name)
        if dim is not None:
            shape[dim] = stop - start
        out = torch.empty(shape, dtype=dtype)
        assert self.read_into(name, dim, start, stop, out)  # fresh, contiguous, its dtype
        return out

    def read_into(self, name: str, dim: int | None, start: int, stop: int | None,
                  out: torch.Tensor) -> bool:
        """Read the slice straight into ``out`` (no staging copy) when it is a CPU tensor of
        the stored dtype whose runs of the slice are each contiguous; False otherwise."""
        dtype, shape, begin = self._info(name)
        if dim is None:
            dim, start, stop = 0, 0, shape[0] if shape else 1
        runs = math.prod(shape[:dim])
        want = shape[:dim] + [stop - start] + shape[dim + 1:] if shape else []
        if list(out.shape) != want or out.dtype != dtype or out.device.type != "cpu":
            return False
        if out.numel() == 0:
            return True
        flat = _runs(out, runs)
        if flat is None:
            return False
        inner = math.prod(shape[dim + 1:]) * dtype.itemsize  # bytes of one index of dim
        stride = shape[dim] * inner if shape else dtype.itemsize  # of one leading index
        width, step = (stop - start) * inner, flat.stride(0) * dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for r in range(runs):
                _pread_into(fd, flat.data_ptr() + r * step, width,
                            begin + r * stride + start * inner)
        finally:
            os.close(fd)
        return True


def _runs(t: torch.Tensor, runs: int) -> torch.Tensor | None:
    """``t`` viewed as ``runs`` rows, each contiguous in memory (a contiguous tensor, or one
    narrowed along a dim: the bytes each leading index of a slice fills); None when it is not
    laid out so."""
    try:
        flat = t.view(runs, -1)
    except RuntimeError:  # not viewable without a copy
        return None
    return flat if flat.shape[1] <= 1 or flat.stride(1) == 1 else None


def _pread_into(fd: int, address: int, size: int, offset: int) -> None:
    """Read ``size`` bytes of ``fd`` at ``offset`` into memory at ``address``."""
    view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
    while size:
        got = os.preadv(fd, [view[-size:]], offset)
        if got <= 0:
            raise TPCompileError(f"short read: {size} bytes missing at offset {offset}")
        size, offset = size - got, offset + got


class HFShardedSource:
    """The tensors of a ``save_pretrained`` directory, read slice by slice on demand."""

    def __init__(self, directory):
        directory = Path(directory)
        try:
            self.weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (OSError, KeyError, ValueError) as e:
            raise TPCompileError(f"{directory / INDEX}: not a readable safetensors index ({e})") from e
        self.directory, self.headers = directory, {}
        missing = sorted({f for f in self.weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise TPCompileError(f"{directory}: the index names shard files that are absent: {missing}")

    def _header(self, name: str) -> _Header:
        file = self.weight_map[name]
        if file not in self.headers:  # opened on first use: only files holding our slices
            self.headers[file] = _Header(self.directory / file)
        return self.headers[file]

    def keys(self):
        return self.weight_map.keys()

    def shape(self, name):
        return tuple(self._header(name).table[name]["shape"])

    def read(self, name, dim=None, start=0, stop=None):
        return self._header(name).tensor(name, dim, start, stop)

    def read_into(self, name, dim, start, stop, out: torch.Tensor) -> bool:
        """The slice read straight into ``out``; False when it cannot be (then use ``read``)."""
        return self._header(name).read_into(name, dim, start, stop, out)

    @property
    def opened(self) -> list[str]:
        """The shard files read so far."""
        return sorted(self.headers)
