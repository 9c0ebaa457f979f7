"""Parameter inventory: name, shape, dtype and sha256 of every array in a model.

Used to prove that sampling changes no parameter byte, and recorded in evidence receipts.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from flax import nnx


def param_inventory(model: nnx.Module) -> dict[str, dict]:
    """`{"path/to/param": {"shape": [...], "dtype": str, "sha256": hex}}` over all variables."""
    _, state = nnx.split(model)
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if not hasattr(value, "shape"):
            continue
        host = np.ascontiguousarray(np.asarray(jax.device_get(value)))
        out["/".join(str(p) for p in path)] = {
            "shape": list(host.shape), "dtype": str(host.dtype), "sha256": hashlib.sha256(host.tobytes()).hexdigest(),
        }
    return out
