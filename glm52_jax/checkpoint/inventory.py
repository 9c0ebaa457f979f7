"""Parameter inventory: name, shape, dtype and sha256 of every array in a model.

Used to prove that sampling changes no parameter byte, and recorded in evidence receipts.
"""

from __future__ import annotations

from flax import nnx

from glm52_jax.evidence.hashing import array_digests


def param_inventory(model: nnx.Module) -> dict[str, dict]:
    """`{"path/to/param": {"shape": [...], "dtype": str, "sha256": hex}}` over all variables."""
    return array_digests(nnx.state(model))
