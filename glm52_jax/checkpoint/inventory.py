"""Parameter inventory: name, shape, dtype and on-device digest of every array in a model.

Used to prove that sampling changes no parameter, and recorded in evidence receipts. The digests
(`checkpoint/digest.py`) are computed where each shard lives, in one jitted program over the whole
state; only the [n_arrays, 4] uint32 table reaches the host, never a parameter. They do not depend on
how the model is sharded, so inventories of differently placed (or multi-process) runs compare.
"""

from __future__ import annotations

from flax import nnx

from glm52_jax.checkpoint.digest import digest_table, hex_digest
from glm52_jax.host_digest import combined_digest
from glm52_jax.model.named_arrays import state_leaves


def named_inventory(leaves: dict[str, object]) -> dict[str, dict]:
    """`{name: {"shape": [...], "dtype": str, "digest": 32 hex chars}}` over `{name: array}`."""
    table = digest_table(list(leaves.values()))  # [n, 4] uint32: the only device-to-host transfer
    return {name: {"shape": list(value.shape), "dtype": str(value.dtype), "digest": hex_digest(row)}
            for (name, value), row in zip(leaves.items(), table, strict=True)}


def state_inventory(state: nnx.State) -> dict[str, dict]:
    """`{"path/to/leaf": {"shape": [...], "dtype": str, "digest": 32 hex chars}}` over a state's arrays."""
    return named_inventory(state_leaves(state))


def inventory_digest(inventory: dict[str, dict]) -> str:
    """One digest (sha256 hex) of a whole inventory (`host_digest.combined_digest`): independent of the mesh and
    the process count, and equal to `checkpoint.file_digest` of a safetensors file of the same arrays."""
    return combined_digest((name, e["shape"], e["dtype"], e["digest"]) for name, e in inventory.items())


def state_digest(state: nnx.State) -> str:
    """`inventory_digest` of a state (a LoRA, its gradients): each process digests its own shards on device,
    nothing is gathered (the sha256 of a whole-state file would need every byte in order on one host)."""
    return inventory_digest(state_inventory(state))


def param_inventory(model: nnx.Module) -> dict[str, dict]:
    """The inventory of every variable of `model` (weights, LoRA, buffers)."""
    return state_inventory(nnx.state(model))


def changed_entries(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """Sorted names whose shape, dtype or digest differ between two inventories, or that only one has."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
