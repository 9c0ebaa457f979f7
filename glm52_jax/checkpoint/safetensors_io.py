"""Minimal safetensors reader/writer with lazy, memory-mapped tensor access.

We parse the format ourselves (8-byte little-endian header size, JSON header, raw little-endian
data) so that: a tensor is read only when asked for, and only the slice asked for is paged in;
bfloat16 works with numpy (via ml_dtypes); and a truncated or corrupt file gets an error naming
the file and the tensor instead of a crash.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class TensorInfo:
    __slots__ = ("name", "dtype", "shape", "begin", "end", "path")

    def __init__(self, name, dtype, shape, begin, end, path):
        self.name, self.dtype, self.shape, self.begin, self.end, self.path = name, dtype, shape, begin, end, path


class SafetensorsFile:
    """One `.safetensors` file: header parsed eagerly, data memory-mapped on first use."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > _MAX_HEADER or 8 + header_len > size:
                raise ValueError(f"{self.path}: truncated or corrupt safetensors file (header length {header_len}, "
                                 f"file size {size})")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: corrupt safetensors header: {e}") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.tensors: dict[str, TensorInfo] = {}
        for name, info in header.items():
            dtype_name = info.get("dtype")
            begin, end = info["data_offsets"]
            shape = tuple(int(s) for s in info["shape"])
            if self.data_start + end > size:
                raise ValueError(f"{self.path}: truncated file: tensor {name!r} needs bytes up to "
                                 f"{self.data_start + end} but the file has {size}")
            self.tensors[name] = TensorInfo(name, dtype_name, shape, begin, end, self.path)
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name` (nothing is read until used)."""
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info.dtype}")
        dtype = DTYPES[info.dtype]
        count = int(np.prod(info.shape, dtype=np.int64))
        if (info.end - info.begin) != count * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} byte range does not match shape {info.shape} "
                             f"and dtype {info.dtype}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[self.data_start + info.begin: self.data_start + info.end]
        return raw.view(dtype).reshape(info.shape)


def write_safetensors(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Writes `(name, array)` pairs; arrays are consumed one at a time (the iterable may be lazy).

    The header needs every shape up front, so pass a list of names with lazily computed arrays via
    `LazyTensor` when memory matters.
    """
    items = list(tensors)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, arr in items:
        dtype = np.dtype(arr.dtype)
        if dtype not in _NAMES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {dtype}")
        nbytes = int(np.prod(arr.shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in items:
            data = arr.materialize() if isinstance(arr, LazyTensor) else arr
            f.write(np.ascontiguousarray(data).tobytes())


class LazyTensor:
    """Shape and dtype now, data on demand: lets the writer hold one tensor in memory at a time."""

    def __init__(self, shape, dtype, fn):
        self.shape, self.dtype, self._fn = tuple(shape), np.dtype(dtype), fn

    def materialize(self) -> np.ndarray:
        data = np.asarray(self._fn())
        if data.shape != self.shape or data.dtype != self.dtype:
            raise AssertionError(f"lazy tensor produced {data.shape}/{data.dtype}, promised {self.shape}/{self.dtype}")
        return data
