"""Parameter inventory: name, shape, dtype and on-device digest of every array in a model.

Used to prove that sampling changes no parameter, and recorded in evidence receipts. The digests
(`checkpoint/digest.py`) are computed where each shard lives, in one jitted program over the whole
state; only the [n_arrays, 4] uint32 table reaches the host, never a parameter. They do not depend on
how the model is sharded, so inventories of differently placed (or multi-process) runs compare.
"""

from __future__ import annotations

from flax import nnx

from glm52_jax.checkpoint.digest import digest_table, hex_digest
from glm52_jax.model.named_arrays import state_leaves


def state_inventory(state: nnx.State) -> dict[str, dict]:
    """`{"path/to/leaf": {"shape": [...], "dtype": str, "digest": 32 hex chars}}` over a state's arrays."""
    leaves = state_leaves(state)
    table = digest_table(list(leaves.values()))  # [n, 4] uint32: the only device-to-host transfer
    return {name: {"shape": list(value.shape), "dtype": str(value.dtype), "digest": hex_digest(row)}
            for (name, value), row in zip(leaves.items(), table, strict=True)}


def param_inventory(model: nnx.Module) -> dict[str, dict]:
    """The inventory of every variable of `model` (weights, LoRA, buffers)."""
    return state_inventory(nnx.state(model))


def changed_entries(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """Sorted names whose shape, dtype or digest differ between two inventories, or that only one has."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
