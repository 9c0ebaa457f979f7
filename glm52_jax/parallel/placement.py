"""Placing a model on a mesh and reading sharded results back, in one process or several.

`place_model` gives every variable the NamedSharding its logical axes ask for (the same placement
`load_pretrained(..., shardings=mesh)` makes from a checkpoint and plan mode's abstract model), the frozen
base weights FSDP-sharded when the rules ask for it (`rules.weight_spec`). It builds each array from the
host value with `make_array_from_callback`, so under `jax.distributed` every process supplies
only its own devices' slices (all processes must hold the same host values, e.g. the same seed).

A base weight may be held as several arrays (an FP8 weight, `model.fp8.Fp8Weight`: e4m3 values of the
weight's shape plus per-block scales): its leaves of the weight's shape are placed like the weight, the others
by the weight's logical axes on the dims of the same size (unblocked: layers, experts) and whole on the rest,
never FSDP-sharded: a block dim's shards need not line up with the weight's, and the scales are 1/(b0 x b1)
of the elements (replicated: 1/4096 of the e4m3 bytes per device for 128 x 128 blocks).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm52_jax.parallel.rules import logical_to_spec, weight_spec


def sharding_for(var: nnx.Variable, mesh: jax.sharding.Mesh) -> NamedSharding:
    """The NamedSharding of one model variable (a real or abstract one) under the active rules table: its
    logical axes' spec; a frozen base weight (`nnx.Param`, not LoRA) also takes the FSDP axes (`weight_spec`).
    A weight held as several arrays gets the same tree of NamedShardings (see the module doc)."""
    value = var.get_value()
    shape = tuple(value.shape)
    axes = var.get_metadata().get("out_sharding") or (None,) * len(shape)
    logical = logical_to_spec(axes, mesh_axes=mesh.axis_names)
    if not isinstance(var, nnx.Param):
        return NamedSharding(mesh, logical)
    weight = NamedSharding(mesh, weight_spec(axes, shape, mesh))
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(value)):
        return weight

    def part(leaf):  # a weight held as several arrays: see the module doc
        if tuple(leaf.shape) == shape:
            return weight
        return NamedSharding(mesh, PartitionSpec(*[s if n == m else None for s, n, m in
                                                   zip(tuple(logical) + (None,) * len(shape), leaf.shape, shape)]))
    return jax.tree.map(part, value)


def place_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """A copy of `model` with every variable (weights, LoRA, ...) sharded by its logical axes."""
    graphdef, state = nnx.split(model)
    leaves = []
    for key, var in nnx.to_flat_state(state):
        placed = jax.tree.map(_place, var.get_value(), sharding_for(var, mesh))
        leaves.append((key, var.replace(placed)))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def _place(value, target: NamedSharding) -> jax.Array:
    if isinstance(value, jax.Array) and value.sharding == target:
        return value  # already placed (e.g. load_pretrained(shardings=mesh)): no host copy
    host = np.asarray(jax.device_get(value))
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


def to_host(tree: Any) -> Any:
    """Every array of `tree` as a full numpy array on every process (an all-gather across hosts for
    arrays sharded over several processes). A replicated array is read from this process's own copy;
    the sharded ones of one mesh are replicated together by ONE jitted program (a gather per array
    would compile and run one small program per array and device: hundreds per LoRA state)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    spread: dict[Any, list[int]] = {}  # mesh -> positions of arrays sharded over several processes
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            out[i] = np.asarray(x)
        elif x.is_fully_addressable:
            out[i] = np.asarray(jax.device_get(x))
        elif x.is_fully_replicated:
            out[i] = np.asarray(x.addressable_data(0))
        elif isinstance(x.sharding, NamedSharding):
            spread.setdefault(x.sharding.mesh, []).append(i)
        else:
            from jax.experimental import multihost_utils
            out[i] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    for mesh, positions in spread.items():
        gathered = _replicator(mesh, len(positions))(*(leaves[i] for i in positions))
        for i, x in zip(positions, gathered):
            out[i] = np.asarray(x.addressable_data(0))
    return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=64)
def _replicator(mesh: Mesh, n: int):
    """A jitted identity of `n` arrays that returns them replicated over `mesh` (kept, so that a later
    gather of the same arrays reuses its program instead of compiling a fresh lambda)."""
    whole = NamedSharding(mesh, PartitionSpec())
    return jax.jit(lambda *xs: xs, out_shardings=(whole,) * n)


def replicated_global(tree: Any) -> Any:
    """Under several processes: every array of `tree` held by one process only (a scalar made outside
    jit, an RNG key) as an array replicated over every device of every process, which is what Orbax
    saves and restores across processes. The value must be the same on every process. Unchanged in
    one process."""
    if jax.process_count() == 1:
        return tree
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())

    def one(x):
        if not isinstance(x, jax.Array) or not x.is_fully_addressable:
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, everywhere, lambda index: host[index])

    return jax.tree.map(one, tree)


class ReplicatedArrayError(RuntimeError):
    """An audit found arrays that live whole on every device (`replicated_live_arrays`)."""


def replicated_live_arrays(min_bytes: int) -> list[str]:
    """Every live array of at least `min_bytes` that lives whole on each of several devices, described
    (shape, dtype, sharding): an audit for arrays replicated by accident (a cache or key stack created
    outside jit, an activation the partitioner could not split). Weights replicated on purpose (TP1)
    count too, so choose `min_bytes` above the largest such weight."""
    return [f"{a.shape} {a.dtype} {a.sharding}" for a in jax.live_arrays()
            if len(a.sharding.device_set) > 1 and a.sharding.is_fully_replicated
            and a.size * a.dtype.itemsize >= min_bytes]
