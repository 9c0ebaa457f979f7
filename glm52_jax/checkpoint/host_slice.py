"""One slice of a (possibly sharded, possibly multi-process) array brought whole to this process: the primitive
every export uses to write a model one tensor at a time, never holding more than one slice on the host."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@functools.cache
def _slicer(mesh: jax.sharding.Mesh, spec: tuple, n_lead: int) -> Callable:
    """Jitted `(x, index int32[n_lead]) -> x[index]` replicated on every device of `mesh`, for an `x`
    sharded by `spec` (one entry per axis). Written with shard_map so that each device touches only its
    own block: the devices holding `index` contribute the slice, the others -0.0 (x + -0.0 == x for every
    float x, so the sum over the indexed axes' shards is exact), then the slice's own sharded axes are
    all-gathered. Memory: one slice per device, never the whole of `x` (a plain dynamic_slice of a
    sharded axis makes XLA all-gather the operand)."""
    def names(entry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    def body(block, index):
        owner = jnp.bool_(True)
        for d in range(n_lead):
            n = block.shape[0]  # this device's share of axis d (the earlier indexed axes are gone)
            first = 0
            for name in names(spec[d]):
                first = first * mesh.shape[name] + jax.lax.axis_index(name)
            local = index[d] - first * n
            owner &= (local >= 0) & (local < n)
            block = jax.lax.dynamic_index_in_dim(block, jnp.clip(local, 0, n - 1), axis=0, keepdims=False)
        lead_names = tuple(n for entry in spec[:n_lead] for n in names(entry))
        if lead_names:
            block = jax.lax.psum(jnp.where(owner, block, jnp.asarray(-0.0, block.dtype)), lead_names)
        for d, entry in enumerate(spec[n_lead:]):
            if names(entry):
                block = jax.lax.all_gather(block, names(entry), axis=d, tiled=True)
        return block

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(*spec), P()), out_specs=P(), check_vma=False))


@jax.jit
def _local_index(x: jax.Array, index: jax.Array) -> jax.Array:
    for i in range(index.shape[0]):  # the positions are traced: one compile per shape, not per layer
        x = jax.lax.dynamic_index_in_dim(x, index[i], axis=0, keepdims=False)
    return x


def local_slice(x, index: tuple[int, ...] = ()) -> jax.Array:
    """`x[index]` (`index`: positions on the leading axes) whole on this process's first local device.

    A sharded `x` (of one process or several) is read with one collective that moves only the slice, so
    every process of a run must call this for the same arrays in the same order; a replicated one is
    read from this process's own copy. Host memory stays one slice, whatever the size of `x`."""
    pos = np.asarray(index, np.int32)
    device = jax.local_devices()[0]
    if not isinstance(x, jax.Array) or x.is_fully_replicated:
        local = x.addressable_data(0) if isinstance(x, jax.Array) else jnp.asarray(x, device=device)
        # A one-device program: outside any enclosing `jax.set_mesh` (export code may run under one), whose
        # devices jit would refuse to mix with this copy's single device.
        with jax.set_mesh(None):
            return jax.device_put(_local_index(local, pos), device)
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"local_slice: cannot read an array sharded by {type(sharding).__name__}")
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    pos = jax.make_array_from_callback(pos.shape, NamedSharding(sharding.mesh, P()), lambda i: pos[i])
    return jax.device_put(_slicer(sharding.mesh, spec, len(index))(x, pos).addressable_data(0), device)


class HostTransfers:
    """What `host_slice` has brought to this host since `reset`: how many arrays, their bytes, the largest."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.count = self.total_bytes = self.largest_bytes = 0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.total_bytes += nbytes
        self.largest_bytes = max(self.largest_bytes, nbytes)


host_transfers = HostTransfers()


def host_slice(x, index: tuple[int, ...] = ()) -> np.ndarray:
    """`local_slice(x, index)` as a numpy array (counted in `host_transfers`)."""
    out = np.asarray(jax.device_get(local_slice(x, index)))
    host_transfers.add(out.nbytes)
    return out
