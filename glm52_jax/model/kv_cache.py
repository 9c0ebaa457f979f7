"""Decode-time cache: what DSA needs of past tokens, per layer.

Per layer the MLA latent (RMS-normed `c_kv`, C wide) and the post-RoPE `k_rope` (R wide); for
'full' indexer layers also the indexer key (post-LayerNorm, post-RoPE, I wide). Nothing per head
is cached: absorbed MLA attends to the latent directly. Arrays are grouped like the model's
layer segments so a segment's scan slices its cache with the same leading axes:

    c_kv[s]:    [repeats, unit_len, B, Cap, C]
    k_rope[s]:  [repeats, unit_len, B, Cap, R]
    index_k[s]: [repeats, full_slots_in_unit, B, Cap, I]   (size 0 on that axis if none)

Slots `>= length` are unused; their position is their slot index, which causality already hides
from every query at a smaller position, so no extra mask is needed. That also makes padding safe:
a cache may have more slots than the model has positions (`slot_capacity` rounds up so that the
devices sharding the slot axis divide it), because slots past the last written token are never
attended, and the sampler refuses prompt + new tokens beyond the position limit.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from glm52_jax.config import ModelConfig
from glm52_jax.parallel.rules import constrain, logical_to_spec

CACHE_AXES = ("layers", None, "batch", "seq", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    c_kv: tuple[jax.Array, ...]
    k_rope: tuple[jax.Array, ...]
    index_k: tuple[jax.Array, ...]
    length: jax.Array  # [] int32: tokens written so far

    @property
    def capacity(self) -> int:
        return self.c_kv[0].shape[3]

    @property
    def batch(self) -> int:
        return self.c_kv[0].shape[2]

    def nbytes(self) -> int:
        """Bytes of the whole (global) cache."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((self.c_kv, self.k_rope, self.index_k)))

    def device_nbytes(self) -> int:
        """Bytes one device holds (the largest share; the whole cache when it is not sharded)."""
        total = 0
        for a in jax.tree.leaves((self.c_kv, self.k_rope, self.index_k)):
            shards = getattr(a, "addressable_shards", None)
            total += max(s.data.nbytes for s in shards) if shards else a.size * a.dtype.itemsize
        return total


def slot_capacity(tokens: int, multiple: int, ways: int = 1) -> int:
    """Cache slots for `tokens` (prompt + new): rounded up to a multiple of lcm(`multiple`, `ways`).

    Not capped at the position limit: the devices sharding the slot axis (`ways`) must divide
    it (jit rejects an unevenly sharded input), and slots past the last position are padding that
    no query attends (module docstring). E.g. 2,097,152 + 16 tokens on 32 slot shards: 2,097,408.
    """
    if tokens <= 0 or multiple <= 0 or ways <= 0:
        raise ValueError(f"slot_capacity needs positive arguments, got {tokens}, {multiple}, {ways}")
    step = math.lcm(multiple, ways)
    return -(-tokens // step) * step


def slot_ways() -> int:
    """Devices the current mesh (if any) and rules split the cache's slot axis over (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    part = logical_to_spec(CACHE_AXES, mesh_axes=mesh.axis_names)[3]
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return math.prod(mesh.shape[n] for n in names)


def init_cache(cfg: ModelConfig, segments, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache for `batch` sequences of up to `capacity` tokens (`segments` from the model).

    Each array carries the cache's logical sharding: traced under a mesh (the sampler builds it
    inside jit), every device allocates only its slots, never a replicated whole cache.
    """
    if capacity <= 0 or batch <= 0:
        raise ValueError(f"cache batch and capacity must be positive, got batch={batch} capacity={capacity}")
    c_kv, k_rope, index_k = [], [], []

    def zeros(shape, dt):
        return constrain(jnp.zeros(shape, dt), CACHE_AXES)

    for seg in segments:
        n = len(seg.unit)
        full = sum(1 for kind in seg.unit if kind[1] == "full")
        c_kv.append(zeros((seg.repeats, n, batch, capacity, cfg.kv_lora_rank), dtype))
        k_rope.append(zeros((seg.repeats, n, batch, capacity, cfg.qk_rope_head_dim), dtype))
        index_k.append(zeros((seg.repeats, full, batch, capacity, cfg.index_head_dim), jnp.float32))
    return KVCache(tuple(c_kv), tuple(k_rope), tuple(index_k), jnp.zeros((), jnp.int32))


def cache_from_entries(new_c, new_r, new_i, seq: int, capacity: int, dtype) -> KVCache:
    """A cache holding a whole prompt's entries (per segment [repeats, U|F, B, S, *], slot order)
    in slots `0 .. S-1` of `capacity`, laid out as `init_cache` + `write_chunk` would leave it."""

    def fill(chunk, dt):
        chunk = chunk.astype(dt)
        full = jnp.pad(chunk, ((0, 0),) * 3 + ((0, capacity - seq), (0, 0)))
        return constrain(full, CACHE_AXES)

    return KVCache(tuple(fill(a, dtype) for a in new_c), tuple(fill(a, dtype) for a in new_r),
                   tuple(fill(a, jnp.float32) for a in new_i), jnp.asarray(seq, jnp.int32))


def broadcast_batch(cache: KVCache, batch: int) -> KVCache:
    """Repeats a batch-1 cache (one shared prompt) to `batch` rows."""
    if cache.batch != 1:
        raise ValueError(f"broadcast_batch needs a batch-1 cache, got batch {cache.batch}")

    def rep(a):
        return jnp.repeat(a, batch, axis=2)

    return KVCache(tuple(map(rep, cache.c_kv)), tuple(map(rep, cache.k_rope)), tuple(map(rep, cache.index_k)),
                   cache.length)


@dataclasses.dataclass(frozen=True)
class LayerCacheView:
    """One layer's part of a segment's stacked cache, read in place (never sliced out).

    c_kv / k_rope: the segment's [repeats, U, B, Cap, *] stacks, `slot` = (repeat, unit slot);
    index_k: the segment's [repeats, F, B, Cap, I] stack with `index_slot` = (repeat, full slot),
    or None on a 'shared' layer. `length`: cached tokens ([] int32).
    """

    c_kv: jax.Array
    k_rope: jax.Array
    index_k: jax.Array | None
    slot: tuple
    index_slot: tuple | None
    length: jax.Array

    @property
    def capacity(self) -> int:
        return self.c_kv.shape[-2]


def write_chunk(cache: KVCache, new_c, new_r, new_i, seq: int) -> KVCache:
    """Writes a chunk's entries (per segment [repeats, U|F, B, S, *]) at slot `length`; length += S.

    One `dynamic_update_slice` per stacked array: under jit, with the cache in a loop carry or
    donated, XLA updates it in place instead of copying the whole cache per layer.
    """

    sharded = slot_ways() > 1

    def put(stack, chunk):
        chunk = chunk.astype(stack.dtype)
        if sharded:
            # A dynamic_update_slice at a traced offset on a sharded axis makes XLA all-gather the
            # whole stack on every device (hundreds of GB per device at 2M). A select keeps every
            # device on its own slots: each one rewrites its shard, taking chunk rows where the
            # chunk lands in it.
            rel = jnp.arange(stack.shape[3], dtype=jnp.int32) - cache.length
            inside = (rel >= 0) & (rel < seq)
            rows = jnp.take(chunk, jnp.clip(rel, 0, seq - 1), axis=3)
            updated = jnp.where(inside[:, None], rows, stack)
        else:
            updated = jax.lax.dynamic_update_slice(stack, chunk, (0, 0, 0, cache.length, 0))
        # The sequence axis stays sharded (context parallel) under a mesh; a no-op without one.
        return constrain(updated, CACHE_AXES)

    return KVCache(tuple(map(put, cache.c_kv, new_c)), tuple(map(put, cache.k_rope, new_r)),
                   tuple(map(put, cache.index_k, new_i)), cache.length + seq)
