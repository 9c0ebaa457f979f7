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
- Bounded memory: mixing a whole array at once materialises its [*S, 4] uint32 lane values, ~8x a
  bf16 parameter (the 2M plan's inventory needed 663 GB of temporaries per device). Arrays of more
  than `CHUNK_BYTES` of words are summed by a `fori_loop` over blocks (`chunk_plan`) instead, each
  word still mixed with its global position, so the sum and digest are bit-identical to the
  whole-array ones and temporaries are bounded by one block: XLA:CPU materialises a step's lane
  values, 4 x `CHUNK_BYTES` (256 MiB) at most, less per device when the array is sharded. The block
  size counts the GLOBAL array, as whether an array is replicated is not known inside `jit` on an
  Auto mesh; a sharded array therefore takes more, smaller steps, each with a u32[4] all-reduce (the
  2M inventory: ~48k steps in all, 1.9 GB of temporaries per device).
- All arrays on one set of devices go through ONE jitted program whose output is a small
  [n_arrays, 4] uint32 table: one dispatch, one compile per state structure, and the only
  device-to-host transfer is that table (fetched with `parallel.placement.to_host`, which also works
  when the devices span several processes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.parallel.placement import to_host

LANES = 4
# Distinct arbitrary 32-bit constants (golden ratio, murmur3/xxhash multipliers): one seed per lane for
# the flat (or inner) index, one per lane for the outer index of very large arrays.
_SEEDS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)
_OUTER_SEEDS = (0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09)
INDEX_LIMIT = 1 << 32  # positions below this are the flat index itself
# Bytes of uint32 words one loop step of `array_digest` covers, all devices together (see `chunk_plan`):
# 64 MiB keeps a step's temporaries (4 lanes per word) near 256 MiB, under 0.3% of a 96 GiB device,
# while keeping the step count of a 1.5 TB model in the tens of thousands.
CHUNK_BYTES = 64 << 20


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


def _strides(shape: tuple[int, ...], axes: range) -> dict[int, int]:
    """{axis: its row-major stride} over the axes `axes` of `shape` (the flat index of that axis group)."""
    strides, stride = {}, 1
    for axis in reversed(axes):
        strides[axis] = stride
        stride *= shape[axis]
    return strides


def _flat_iota(shape: tuple[int, ...], coefs: dict[int, int], offset: jax.Array | None = None) -> jax.Array:
    """[*shape] uint32: `offset + sum_a iota_a * coefs[a]` over the axes in `coefs`, wrapping mod 2^32."""
    index = jnp.zeros(shape, jnp.uint32) if offset is None else jnp.broadcast_to(offset, shape)
    for axis in sorted(coefs, reverse=True):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(coefs[axis] % INDEX_LIMIT)
    return index


def position_keys(shape: tuple[int, ...], limit: int = INDEX_LIMIT) -> tuple[jax.Array, jax.Array | None]:
    """(inner, outer) uint32 [*shape] indices of every element; `outer` is None when size < `limit`
    (then `inner` is the flat index). `limit` is a parameter only so tests can reach the split path."""
    k = _inner_axes(shape, limit)
    inner = _flat_iota(shape, _strides(shape, range(k, len(shape))))
    return inner, (_flat_iota(shape, _strides(shape, range(k))) if k else None)


def _lane_sums(words: jax.Array, inner: jax.Array, outer: jax.Array | None, mask: jax.Array | None = None
               ) -> jax.Array:
    """[LANES] uint32: sum over `words` [*W] (where `mask` [*W], if given) of fmix32(word ^ mix(position))
    per lane (mod 2^32)."""
    # Lanes on a trailing axis: one fused elementwise-and-reduce per array rather than one per lane.
    seeds, outer_seeds = jnp.asarray(_SEEDS, jnp.uint32), jnp.asarray(_OUTER_SEEDS, jnp.uint32)
    mixed_index = fmix32(inner[..., None] + seeds)  # [*W, LANES]
    if outer is not None:
        mixed_index = fmix32(mixed_index ^ fmix32(outer[..., None] + outer_seeds))
    values = fmix32(words[..., None] ^ mixed_index)  # [*W, LANES]
    if mask is not None:
        values = jnp.where(mask[..., None], values, jnp.uint32(0))
    return jnp.sum(values, axis=tuple(range(words.ndim)), dtype=jnp.uint32)


class AxisCut(NamedTuple):
    """How the loop of `array_digest` walks one axis of m elements: reshaped to [groups, m / groups], it
    reads `block` consecutive elements of the second factor per step, in `blocks` steps (the last block
    ends at the axis' end and overlaps the one before it when `block` does not divide m / groups)."""

    groups: int  # gcd(m, devices)
    length: int  # m / groups, the walked factor
    block: int
    blocks: int


def chunk_plan(shape: tuple[int, ...], word_bytes: int, chunk_bytes: int, devices: int) -> tuple[AxisCut, ...]:
    """Per axis of `shape`, its `AxisCut`: a loop step reads [groups_0, block_0, groups_1, block_1, ...].

    Axes are cut leading axis first, each into as many blocks as the step still needs to hold at most
    about `chunk_bytes` of words (`word_bytes` per element). groups = gcd(m, devices) is a multiple of
    every device count that can shard the axis evenly, so the reshape to [groups, m / groups] keeps
    each device's shard on its device, the blocks run along an axis no device splits, and a step reads
    a slice of every shard (no gather; every device busy every step). An axis gives at most
    m / groups blocks, so a step can exceed `chunk_bytes` when the axes have no more room.
    """
    need = -(-math.prod(shape) * word_bytes // chunk_bytes)  # steps wanted
    cuts = []
    for size in shape:
        groups = math.gcd(size, devices)
        free = size // groups
        block = -(-free // min(max(need, 1), free))
        cuts.append(AxisCut(groups, free, block, -(-free // block)))
        need = -(-need // cuts[-1].blocks)
    return tuple(cuts)


def _digits(step: jax.Array, cuts: tuple[AxisCut, ...]) -> list[jax.Array]:
    """The block index of every axis for loop step `step` (mixed radix, last axis fastest; its dtype)."""
    digits, rest = [], step
    for cut in reversed(cuts):
        digits.append(rest % cut.blocks if cut.blocks > 1 else jnp.zeros_like(step))
        rest = rest // cut.blocks
    return digits[::-1]


def _explicit_sharding(x: jax.Array, pattern) -> NamedSharding | None:
    """`x`'s type sharding with the spec `pattern(axes)` of its per-axis mesh axes, when its type names any
    (Explicit mesh axes, which a reshape must be told about); None otherwise (Auto axes: the partitioner
    propagates the sharding itself)."""
    sharding = jax.typeof(x).sharding
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return sharding.update(spec=P(*pattern(spec))) if any(axes is not None for axes in spec) else None


def _chunk_positions(shape: tuple[int, ...], strides: dict[int, int], cuts: tuple[AxisCut, ...],
                     starts: list[jax.Array]) -> jax.Array:
    """[*shape] uint32 flat index over one index group (`strides`: {array axis: stride}) of a step's
    chunk [g_0, b_0, g_1, b_1, ..., *word axes]: on axis a the element (p, i) has coordinate
    p * (m_a / g_a) + starts[a] + i, so its stride splits into p's and i's and starts[a] joins the offset."""
    coefs, terms = {}, []
    for axis, stride in strides.items():
        if axis >= len(cuts):  # the word axis of 8-byte types, never cut
            coefs[2 * len(cuts)] = stride
            continue
        cut = cuts[axis]
        coefs[2 * axis], coefs[2 * axis + 1] = stride * cut.length, stride
        if cut.blocks > 1:
            terms.append(starts[axis].astype(jnp.uint32) * jnp.uint32(stride % INDEX_LIMIT))
    return _flat_iota(shape, coefs, sum(terms[1:], terms[0]) if terms else None)


def _tail_mask(shape: tuple[int, ...], cuts: tuple[AxisCut, ...], digits: list[jax.Array],
               starts: list[jax.Array]) -> jax.Array | None:
    """[*shape] bool: False where a last block re-reads elements of the block before it (None: no overlap)."""
    mask = None
    for axis, cut in enumerate(cuts):
        if cut.block * cut.blocks > cut.length:
            # Block d is meant to start at d * block; a clamped last block starts earlier.
            fresh = jax.lax.broadcasted_iota(jnp.int32, shape, 2 * axis + 1) + starts[axis] >= digits[axis] * cut.block
            mask = fresh if mask is None else mask & fresh
    return mask


def array_digest(x: jax.Array, limit: int = INDEX_LIMIT, chunk_bytes: int = CHUNK_BYTES) -> jax.Array:
    """[LANES] uint32 digest of one array (call inside `jit`; see the module docstring). Arrays of more
    than `chunk_bytes` of words are summed by a loop over the blocks of `chunk_plan`, so temporaries
    are bounded by a block, not by the array; `limit` and `chunk_bytes` are parameters only so tests
    can reach the split-index and chunked paths."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)  # typed PRNG keys: their uint32 key data, [*S, key words]
    word_axes = (2,) if jnp.dtype(x.dtype).itemsize == 8 else ()  # 8-byte types: two words per element
    word_shape = x.shape + word_axes
    k = _inner_axes(word_shape, limit)
    cuts = chunk_plan(x.shape, 4 * math.prod(word_axes), chunk_bytes, jax.device_count())
    steps = math.prod(cut.blocks for cut in cuts)
    if steps == 1:
        return _lane_sums(as_words(x), *position_keys(word_shape, limit))

    groups = [_strides(word_shape, range(k, len(word_shape))), _strides(word_shape, range(k))]  # inner, outer
    # [g_0, m_0 / g_0, g_1, ...]; an axis' sharding (named in its type on Explicit meshes) goes to its groups.
    split_sharding = _explicit_sharding(x, lambda spec: (n for axes in spec for n in (axes, None)))
    split_x = jax.lax.reshape(x, tuple(n for cut in cuts for n in (cut.groups, cut.length)),
                              out_sharding=split_sharding)
    block_shape = tuple(n for cut in cuts for n in (cut.groups, cut.block))

    def step(j, sums):
        digits = _digits(j, cuts)
        starts = [jnp.minimum(digit * cut.block, cut.length - cut.block) for digit, cut in zip(digits, cuts)]
        chunk = jax.lax.dynamic_slice(split_x, [n for start in starts for n in (jnp.zeros_like(start), start)],
                                      block_shape)
        words = as_words(chunk)  # [g_0, b_0, g_1, b_1, ..., *word axes]
        inner, outer = (_chunk_positions(words.shape, group, cuts, starts) if group else None for group in groups)
        return sums + _lane_sums(words, inner, outer, _tail_mask(words.shape, cuts, digits, starts))

    return jax.lax.fori_loop(0, steps, step, jnp.zeros(LANES, jnp.uint32))


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
