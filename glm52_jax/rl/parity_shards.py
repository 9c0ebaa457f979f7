"""Every LoRA gradient shard as it lives on each device, exported for parity (the seed's shard-level export).

Each process writes, for the devices it addresses, into `directory`:

  <stem>-p<k>.json          one record per device shard: name, device, process, index ([[start, stop], ...]
                            per axis), replica id, shape, dtype, sha256 of its bytes (C order), finite flag,
                            nonzero count
  <stem>-p<k>.safetensors   the values of the shards with replica id 0 (each distinct shard once), keyed
                            `name[start:stop,...]`

Every device's copy is hashed, so a replica that diverged from its peers shows up as a different hash
for the same (name, index). Only addressable shards are read: no gather, no process holds more than
its own devices' gradients. `ShardedArrays` reads whole arrays back one at a time (parity's comparison on
process 0), `assemble` all at once (tests, offline comparisons).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from glm52_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from glm52_jax.evidence.atomic import atomic_write_json


def _index(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    """A shard's tuple of slices -> [[start, stop], ...] over every axis."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)] if index else []


def _key(name: str, index: list[list[int]]) -> str:
    return name + "[" + ",".join(f"{a}:{b}" for a, b in index) + "]"


def file_names(stem: str, process: int) -> tuple[str, str]:
    return f"{stem}-p{process}.json", f"{stem}-p{process}.safetensors"


def export_shards(arrays: Mapping[str, Any], directory: str | os.PathLike, stem: str, process: int
                  ) -> list[dict[str, Any]]:
    """Writes this process's shards of `arrays` ({name: jax.Array}); returns its records."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    records, values = [], {}
    for name in sorted(arrays):
        array = arrays[name]
        for shard in sorted(array.addressable_shards, key=lambda s: s.device.id):
            data = np.ascontiguousarray(np.asarray(shard.data))
            index = _index(shard.index, array.shape)
            records.append({"name": name, "device": shard.device.id, "process": process, "index": index,
                            "replica": shard.replica_id, "shape": list(data.shape), "dtype": str(data.dtype),
                            "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
                            "finite": bool(np.isfinite(data).all()), "nonzero": int(np.count_nonzero(data))})
            if shard.replica_id == 0:
                values[_key(name, index)] = data
    meta, tensors = file_names(stem, process)
    tmp = directory / (tensors + ".tmp")
    write_safetensors(tmp, sorted(values.items()), metadata={"format": "glm52-jax/parity-shards"})
    os.replace(tmp, directory / tensors)  # complete or absent
    atomic_write_json(directory / meta, records, overwrite=False, indent=1, sort_keys=True)
    return records


def read_records(directory: str | os.PathLike, stem: str, processes: int) -> list[dict[str, Any]]:
    """Every process's shard records (after a barrier: each process wrote its own)."""
    out = []
    for k in range(processes):
        out += json.loads((Path(directory) / file_names(stem, k)[0]).read_text())
    return out


class ShardedArrays(Mapping):
    """`{name: whole array}` over the exported shards of every process, each array assembled only when indexed
    (and not kept): a comparison that takes one name at a time holds one array, never all the gradients.
    Every element must be covered by a stored shard."""

    def __init__(self, directory: str | os.PathLike, stem: str, processes: int):
        self._directory, self._stem = Path(directory), stem
        records = read_records(directory, stem, processes)
        self._shapes: dict[str, list[int]] = {}
        self._dtypes: dict[str, str] = {}
        for r in records:  # an array's shape: the largest stop per axis over its shards
            stops = [b for _, b in r["index"]] if r["index"] else []
            self._shapes[r["name"]] = [max(x) for x in zip(self._shapes.get(r["name"], stops), stops)] if stops else []
            self._dtypes.setdefault(r["name"], r["dtype"])
        self._files = [SafetensorsFile(Path(directory) / file_names(stem, k)[1]) for k in range(processes)]
        self._keys: dict[str, list[tuple[SafetensorsFile, str]]] = {}  # name -> (file, stored key) of its shards
        for f in self._files:
            for key in f.keys():
                self._keys.setdefault(key.rpartition("[")[0], []).append((f, key))

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        out = np.zeros(self._shapes[name], dtype=np.dtype(self._dtypes[name]))
        covered = np.zeros(out.shape, dtype=bool)
        for f, key in self._keys.get(name, ()):
            spans = [tuple(map(int, p.split(":"))) for p in key.rpartition("[")[2].rstrip("]").split(",") if p]
            where = tuple(slice(a, b) for a, b in spans)
            out[where] = f.get(key)
            covered[where] = True
        if not covered.all():
            raise ValueError(f"parity shards under {self._directory}: no stored shard covers part of {name}")
        return out

    def __iter__(self):
        return iter(sorted(self._shapes))

    def __len__(self) -> int:
        return len(self._shapes)


def assemble(directory: str | os.PathLike, stem: str, processes: int) -> dict[str, np.ndarray]:
    """Whole arrays from the exported shards (all at once: tests, offline comparisons)."""
    return dict(ShardedArrays(directory, stem, processes))
