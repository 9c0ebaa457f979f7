"""A model state (the LoRA) written as one safetensors file, one tensor at a time: the receipt's
lora_before/lora_after files without the state ever whole on a device or a host.

Tensors are named as the inventory names them (`model.named_arrays.state_leaves`) and written in name
order. An array this process holds whole (one process) is read from its shards by the host; an array
spread over several processes is brought to this process alone with `host_slice` (one collective that
moves that tensor only), so every process calls `write_state_file`, in the same order, and only the
writer passes a path. Host memory: the largest tensor (plus the file's header).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from glm52_jax.checkpoint.host_slice import host_slice, local_slice
from glm52_jax.checkpoint.safetensors_io import LazyTensor, write_safetensors
from glm52_jax.model.named_arrays import state_leaves


def _needs_collective(x) -> bool:
    """Sharded over several processes: reading it takes every process (replicated ones are read locally)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated


def _fetch(x) -> np.ndarray:
    if _needs_collective(x):
        return host_slice(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # replicated: this process's own copy
        return np.asarray(x.addressable_data(0))
    return np.asarray(jax.device_get(x))


def write_state_file(state, path: str | os.PathLike | None) -> None:
    """Writes `state`'s arrays to `path` (atomically: complete or absent); `path` None on the processes that
    write nothing, which still join each sharded tensor's collective."""
    leaves = dict(sorted(state_leaves(state).items()))
    if path is None:
        for x in leaves.values():
            if _needs_collective(x):
                local_slice(x)
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tensors = [(name, LazyTensor(x.shape, np.dtype(x.dtype), lambda x=x: _fetch(x))) for name, x in leaves.items()]
    write_safetensors(tmp, tensors)
    os.replace(tmp, path)
