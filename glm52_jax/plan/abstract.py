"""Abstract (never materialised) model state, caches and inputs, sharded as a real run places them.

Every array is a `jax.ShapeDtypeStruct` carrying the `NamedSharding` its logical axes get under the
active rules (`parallel.rules.axis_rules`), so a jit lowered on them compiles the SPMD program a
run with real weights would, and per-device bytes follow from the shardings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.checkpoint import hf, hf_fp8
from glm52_jax.model.kv_cache import CACHE_AXES, KVCache, init_cache, scale_axes, slot_stride
from glm52_jax.model.shared_cache import SUFFIX_AXES, SuffixCache, init_suffix
from glm52_jax.model.transformer import GlmMoeDsa, layer_kinds, plan_segments
from glm52_jax.parallel.placement import sharding_for
from glm52_jax.parallel.rules import logical_to_spec


def sds(shape: Sequence[int], dtype, mesh, axes: Sequence[str | None] | None) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct sharded by logical `axes` (None: replicated) under the active rules."""
    spec = P() if axes is None else logical_to_spec(axes, mesh_axes=mesh.axis_names)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))


def sds_even(shape: Sequence[int], dtype, mesh, axes: Sequence[str | None]) -> jax.ShapeDtypeStruct:
    """`sds`, leaving unsharded any axis its mesh axes do not divide (small inputs like token ids)."""
    spec = logical_to_spec(axes, mesh_axes=mesh.axis_names)
    kept = [a if dim % mesh_ways(mesh, part) == 0 else None for a, dim, part in zip(axes, shape, spec)]
    return sds(shape, dtype, mesh, kept)


def mesh_ways(mesh, part) -> int:
    """Devices one PartitionSpec entry (None, a mesh axis name or a tuple of them) splits an axis over."""
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return math.prod(mesh.shape[a] for a in names)


def ways(mesh, logical: str) -> int:
    """How many ways the active rules shard logical axis `logical` on `mesh`."""
    return mesh_ways(mesh, logical_to_spec((logical,), mesh_axes=mesh.axis_names)[0])


def itemsize(dtype) -> int:
    # PRNG key dtypes (key<fry>) are not numpy dtypes but carry their width.
    return int(getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize)


def shard_bytes(x: jax.ShapeDtypeStruct) -> int:
    """Bytes one device holds of a sharded ShapeDtypeStruct (jit inputs shard evenly)."""
    return math.prod(x.sharding.shard_shape(tuple(x.shape))) * itemsize(x.dtype)


def tree_bytes(tree, per_device: bool) -> int:
    """Bytes of every array leaf of `tree`: one device's shards, or the global arrays."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
    if per_device:
        return sum(shard_bytes(x) for x in leaves)
    return sum(math.prod(x.shape) * itemsize(x.dtype) for x in leaves)


def cache_bytes(cache: KVCache | SuffixCache, per_device: bool) -> int:
    """Bytes of a cache's arrays, an FP8 cache's scales included (not its `length` scalar)."""
    return tree_bytes(cache.stacks(), per_device)


def abstract_model(cfg, opts, mesh, fp8=None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the model with every array a sharded ShapeDtypeStruct.

    `nnx.eval_shape` traces the constructor only; each variable's `out_sharding` metadata (its
    logical axes, 'layers' prepended on scanned stacks) picks its NamedSharding, exactly as
    `load_pretrained(..., shardings=mesh)` places real weights. `fp8` (a `checkpoint.hf_fp8.Fp8Config`, or
    None for weights of `opts.param_dtype`): the base weights `hf.fp8_key` selects are `Fp8Weight`s (e4m3
    values, float32 scales on `hf_fp8.fp8_param`'s grid) placed as `hf_fp8.materialize` places a loaded one.
    """
    abstract = nnx.eval_shape(lambda: GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    leaves = []
    for key, var in nnx.to_flat_state(state):
        value = var.get_value()
        shape = tuple(value.shape)
        if fp8 is not None and isinstance(var, nnx.Param) and hf.fp8_key(cfg, key, fp8):
            value = hf_fp8.fp8_struct(hf_fp8.fp8_param(cfg, fp8, key, shape), shape, value.dtype)
        sharding = sharding_for(var.replace(value), mesh)  # FSDP-sharded base weights included
        leaves.append((key, var.replace(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=s), value, sharding))))
    return graphdef, nnx.from_flat_state(leaves)


def model_segments(cfg) -> tuple:
    """The model's layer segments (what `init_cache` lays the cache out by)."""
    return tuple(plan_segments(layer_kinds(cfg)))


def abstract_cache(cfg, segments, batch: int, capacity: int, dtype, mesh, cache_dtype: str = "auto") -> KVCache:
    """A KVCache of ShapeDtypeStructs ([batch, capacity] slots per layer, stored as `cache_dtype`), slots
    sharded like `write_chunk` keeps them (CACHE_AXES); the `length` scalar replicated."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, segments, batch, capacity, dtype, cache_dtype))
    # Laid out over the mesh's slot shards as `init_cache` lays it out under that mesh (traced here without one).
    return dataclasses.replace(_abstract(shapes, CACHE_AXES, mesh), stride=slot_stride(capacity, mesh))


def abstract_suffix(cfg, segments, rows: int, capacity: int, dtype, mesh, cache_dtype: str = "auto") -> SuffixCache:
    """A per-sample SuffixCache of ShapeDtypeStructs (`rows` x `capacity` slots per layer, stored as
    `cache_dtype`), placed as `init_suffix` places it (SUFFIX_AXES: slots not sharded); the `length` scalar
    replicated."""
    shapes = jax.eval_shape(lambda: init_suffix(cfg, segments, rows, capacity, dtype, cache_dtype))
    return _abstract(shapes, SUFFIX_AXES, mesh)


def _abstract(shapes, axes, mesh):
    """`shapes` (a KVCache / SuffixCache of shapes) with every stack sharded by `axes` (an FP8 cache's scale
    stacks by `axes` without the feature axis), `length` replicated."""
    def put(stacks, stack_axes=axes):
        return tuple(sds(a.shape, a.dtype, mesh, stack_axes) for a in stacks)

    return type(shapes)(put(shapes.c_kv), put(shapes.k_rope), put(shapes.index_k), sds((), jnp.int32, mesh, None),
                        put(shapes.c_scale, scale_axes(axes)), put(shapes.i_scale, scale_axes(axes)))
