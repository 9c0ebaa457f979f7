"""sha256 of bytes, files and model state, written once for receipts, inventories and exports.

Imports neither JAX nor numpy at module level (the evidence verifier starts without them); the state
functions import them when called.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """Streams the file in 1 MiB reads (checkpoint shards can be many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def state_arrays(state) -> dict[str, Any]:
    """An `nnx.State` as `{"path/to/leaf": host array}` (C-contiguous), leaves without a shape skipped.

    An array spread over several processes is all-gathered (a collective: every process of the run
    must call this for the same state)."""
    import numpy as np

    from glm52_jax.model.named_arrays import state_leaves
    from glm52_jax.parallel.placement import to_host

    named = state_leaves(state)  # the inventory's names: an FP8 weight as its values and scales
    return {name: np.ascontiguousarray(a) for name, a in to_host(named).items()}  # one gather for all


def state_bytes(state) -> bytes:
    """An `nnx.State` as one safetensors blob (deterministic: names sorted, fixed header)."""
    from safetensors.numpy import save

    return save(dict(sorted(state_arrays(state).items())))


def state_sha256(state) -> str:
    return sha256_bytes(state_bytes(state))


def array_digests(state) -> dict[str, dict[str, Any]]:
    """`{"path/to/leaf": {"shape": [...], "dtype": str, "sha256": hex}}` over the state's arrays."""
    return {name: {"shape": list(a.shape), "dtype": str(a.dtype), "sha256": sha256_bytes(a.tobytes())}
            for name, a in state_arrays(state).items()}
