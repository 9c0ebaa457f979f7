"""Every LoRA gradient shard as it lives on each device, exported for parity (the seed's shard-level export).

Each process writes, for the devices it addresses, into `directory`:

  <stem>-p<k>.json          one record per device shard: name, device, process, index ([[start, stop], ...]
                            per axis), replica id, shape, dtype, sha256 of its bytes (C order), finite flag,
                            nonzero count
  <stem>-p<k>.safetensors   the values of the shards with replica id 0 (each distinct shard once), keyed
                            `name[start:stop,...]`

Every device's copy is hashed, so a replica that diverged from its peers shows up as a different hash
for the same (name, index). Only addressable shards are read: no gather, no process holds more than
its own devices' gradients. `assemble` rebuilds whole arrays from the files (tests, offline comparisons).
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


def assemble(directory: str | os.PathLike, stem: str, processes: int) -> dict[str, np.ndarray]:
    """Whole arrays from the exported shards; every element must be covered by a stored shard."""
    records = read_records(directory, stem, processes)
    shapes: dict[str, list[int]] = {}
    for r in records:  # an array's shape: the largest stop per axis over its shards
        stops = [b for _, b in r["index"]] if r["index"] else []
        shapes[r["name"]] = [max(x) for x in zip(shapes.get(r["name"], stops), stops)] if stops else []
    out = {n: np.zeros(s, dtype=np.dtype(next(r["dtype"] for r in records if r["name"] == n)))
           for n, s in shapes.items()}
    covered = {n: np.zeros(s, dtype=bool) for n, s in shapes.items()}
    for k in range(processes):
        stored = SafetensorsFile(Path(directory) / file_names(stem, k)[1])
        for key in stored.keys():
            name, _, rest = key.rpartition("[")
            spans = [tuple(map(int, p.split(":"))) for p in rest.rstrip("]").split(",") if p]
            where = tuple(slice(a, b) for a, b in spans)
            out[name][where] = stored.get(key)
            covered[name][where] = True
    holes = [n for n, c in covered.items() if not c.all()]
    if holes:
        raise ValueError(f"parity shards under {directory}: no stored shard covers part of {holes[:3]}")
    return out
