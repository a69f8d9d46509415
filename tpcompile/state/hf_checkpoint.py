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

    def tensor(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        info = self.table[name]
        if info["dtype"] not in _DTYPES:
            raise TPCompileError(f"{self.path.name}: {name} has dtype {info['dtype']}, not readable")
        dtype, shape = _DTYPES[info["dtype"]], list(info["shape"])
        item = dtype.itemsize
        begin = self.base + info["data_offsets"][0]
        if dim is None:
            dim, start, stop = 0, 0, shape[0] if shape else 1
        inner = math.prod(shape[dim + 1:]) * item        # bytes of one index of dim
        stride = shape[dim] * inner if shape else item   # bytes of one leading index
        runs = math.prod(shape[:dim])
        out = bytearray((stop - start) * inner * runs)
        width = (stop - start) * inner
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for r in range(runs):
                chunk = os.pread(fd, width, begin + r * stride + start * inner)
                out[r * width:(r + 1) * width] = chunk
        finally:
            os.close(fd)
        local = shape[:dim] + [stop - start] + shape[dim + 1:] if shape else []
        return torch.frombuffer(out, dtype=dtype).reshape(local) if out else torch.empty(local, dtype=dtype)


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

    @property
    def opened(self) -> list[str]:
        """The shard files read so far."""
        return sorted(self.headers)
