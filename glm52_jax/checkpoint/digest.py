"""Digests of device arrays computed where the arrays live: 128 bits per array, independent of sharding.

What it is: change detection for model state (did sampling alter a parameter? which array did a
step change?), 4 lanes of 32 bits each. It is NOT a cryptographic hash: nothing stops a deliberate
collision; it guards against accidents (a stray write, a wrong donation, a reused buffer).

How: an array's bits are viewed as unsigned 32-bit words (`lax.bitcast_convert_type`; 8- and 16-bit
types widened to one word per element, 64-bit types split into two, bool as 0/1). Lane `l` maps the
word at flat position `i` to `fmix32(word ^ fmix32(i + seed_l))` (murmur3's finaliser, a bijection of
uint32) and sums the results mod 2^32.

Why this shape:
- Integer addition mod 2^32 is associative and commutative, so the sum is bit-identical for every
  sharding, device count, process count and reduction order: a 2-process run's inventory can be
  compared with a 1-process run's. (A sequential hash such as sha256 would need the bytes in order on
  one host: a whole-model gather, 1.5 TB at the 2M configuration.)
- The flat index is an `iota` over the array's GLOBAL shape inside `jit`; XLA's partitioner gives each
  shard its own offsets, so each word is mixed with its true position and moving a value (swapping two
  elements) changes the digest.
- Both mixes are bijections, so changing any single element changes every lane (guaranteed); for
  several changes a lane collides with probability about 2^-32, and the four differently seeded lanes
  together (treated as independent) about 2^-128.
- Arrays with 2^32 elements or more: the flat index no longer fits a uint32, so the position is split
  as (outer, inner) over the leading and trailing axes (inner spans the longest run of trailing axes
  with fewer than 2^32 elements) and the outer index is mixed in as well. Smaller arrays use the flat
  index as is.
- All arrays on one set of devices go through ONE jitted program whose output is a small
  [n_arrays, 4] uint32 table: one dispatch, one compile per state structure, and the only
  device-to-host transfer is that table (fetched with `parallel.placement.to_host`, which also works
  when the devices span several processes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm52_jax.parallel.placement import to_host

LANES = 4
# Distinct arbitrary 32-bit constants (golden ratio, murmur3/xxhash multipliers): one seed per lane for
# the flat (or inner) index, one per lane for the outer index of very large arrays.
_SEEDS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)
_OUTER_SEEDS = (0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09)
INDEX_LIMIT = 1 << 32  # positions below this are the flat index itself


def fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser (a bijection of uint32; all arithmetic wraps mod 2^32)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def as_words(x: jax.Array) -> jax.Array:
    """The bits of `x` [*S] as uint32 words: [*S] (types of 4 bytes or fewer) or [*S, 2] (8-byte types)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)  # typed PRNG keys: their uint32 key data, [*S, key words]
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if dtype.kind == "c":
        raise TypeError(f"array digest: complex dtype {dtype} is not supported; digest its real and imaginary parts")
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(dtype.itemsize)
    if unsigned is None:
        raise TypeError(f"array digest: dtype {dtype} ({dtype.itemsize} bytes per element) is not supported")
    words = jax.lax.bitcast_convert_type(x, unsigned)  # 8 bytes -> [*S, 2] uint32
    return words.astype(jnp.uint32)


def _inner_axes(shape: tuple[int, ...], limit: int) -> int:
    """The first axis of the longest run of trailing axes with fewer than `limit` elements."""
    k = len(shape)
    while k > 0 and math.prod(shape[k - 1:]) < limit:
        k -= 1
    if math.prod(shape[:k]) >= limit:
        raise ValueError(f"array digest: shape {shape} has an axis run too long to index with two uint32 words")
    return k


def _flat_iota(shape: tuple[int, ...], axes: range) -> jax.Array:
    """[*shape] uint32: the row-major flat index over `axes` of every element (wrapping mod 2^32)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(axes):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % INDEX_LIMIT)
        stride *= shape[axis]
    return index


def position_keys(shape: tuple[int, ...], limit: int = INDEX_LIMIT) -> tuple[jax.Array, jax.Array | None]:
    """(inner, outer) uint32 [*shape] indices of every element; `outer` is None when size < `limit`
    (then `inner` is the flat index). `limit` is a parameter only so tests can reach the split path."""
    k = _inner_axes(shape, limit)
    inner = _flat_iota(shape, range(k, len(shape)))
    return inner, (_flat_iota(shape, range(k)) if k else None)


def array_digest(x: jax.Array, limit: int = INDEX_LIMIT) -> jax.Array:
    """[LANES] uint32 digest of one array (call inside `jit`; see the module docstring)."""
    words = as_words(x)
    inner, outer = position_keys(words.shape, limit)
    # Lanes on a trailing axis: one fused elementwise-and-reduce per array rather than one per lane.
    seeds, outer_seeds = jnp.asarray(_SEEDS, jnp.uint32), jnp.asarray(_OUTER_SEEDS, jnp.uint32)
    mixed_index = fmix32(inner[..., None] + seeds)  # [*W, LANES]
    if outer is not None:
        mixed_index = fmix32(mixed_index ^ fmix32(outer[..., None] + outer_seeds))
    return jnp.sum(fmix32(words[..., None] ^ mixed_index), axis=tuple(range(words.ndim)), dtype=jnp.uint32)


@jax.jit
def _digest_table(arrays: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.stack([array_digest(x) for x in arrays])


def _device_group(x) -> frozenset[int] | None:
    """The device ids a committed array lives on (None: host values and uncommitted arrays, which go anywhere)."""
    if isinstance(x, jax.Array) and x.committed:
        return frozenset(d.id for d in x.sharding.device_set)
    return None


def digest_table(arrays: Sequence[jax.Array]) -> np.ndarray:
    """[n_arrays, LANES] uint32 digests of `arrays` on the host; only these rows leave the devices.

    One jitted program per set of devices the arrays live on (one for a placed model; a jitted call
    cannot mix arrays committed to different devices), each fetched as one small table.
    """
    groups: dict[frozenset[int] | None, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(_device_group(x), []).append(i)
    table = np.zeros((len(arrays), LANES), np.uint32)
    for indices in groups.values():
        table[indices] = to_host(_digest_table(tuple(arrays[i] for i in indices)))
    return table


def hex_digest(row: np.ndarray) -> str:
    """One table row [LANES] uint32 as 32 hex characters (lane 0 first, each lane big-endian)."""
    return "".join(f"{int(word):08x}" for word in row)
