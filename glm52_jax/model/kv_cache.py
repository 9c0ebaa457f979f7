"""Decode-time cache: what DSA needs of past tokens, per layer.

Per layer the MLA latent (RMS-normed `c_kv`, C wide) and the post-RoPE `k_rope` (R wide); for
'full' indexer layers also the indexer key (post-LayerNorm, post-RoPE, I wide). Nothing per head
is cached: absorbed MLA attends to the latent directly. Arrays are grouped like the model's
layer segments so a segment's scan slices its cache with the same leading axes:

    c_kv[s]:    [repeats, unit_len, B, Cap, C]
    k_rope[s]:  [repeats, unit_len, B, Cap, R]
    index_k[s]: [repeats, full_slots_in_unit, B, Cap, I]   (size 0 on that axis if none)

With `cache_dtype="float8_e4m3fn"` (`model/cache_fp8.py`) c_kv and index_k hold float8 e4m3 values and
two more stacks hold one float32 scale per row (the row axes without the feature axis):

    c_scale[s]: [repeats, unit_len, B, Cap]
    i_scale[s]: [repeats, full_slots_in_unit, B, Cap]

With "auto" (the model dtype) `c_scale` and `i_scale` are empty tuples: no leaves, the same programs as before.

Slot layout: under a mesh that shards the slot axis over N devices (`slot_axes`), slot s lives on device
s % N at local row s // N (`SlotLayout`; `KVCache.stride` = N, 1 = slot order). Strided, not contiguous:
every query attends only to keys at or before its position, so with contiguous shards the devices holding
the earliest slots score a full share on every chunk and the ones past `length` none (the device with the
newest keys did ~1.88x the mean indexer work over a 2M chunked prefill on 8 devices). Dealt round-robin,
every device holds ceil or floor of length / N filled slots and a chunk's rows split evenly, so each
chunk's indexer, attention and write work is the same on every device. The global array is therefore in
device-major order (index (s % N) * Cap/N + s // N), not slot order: only readers that know the layout
(the context-parallel paths, `SlotLayout`) may index it; `KVCache.relayout(1)` gives the slot order.

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
from jax.sharding import PartitionSpec as P

from glm52_jax.config import ModelConfig
from glm52_jax.model import cache_fp8
from glm52_jax.parallel.rules import constrain, logical_to_spec

CACHE_AXES = ("layers", None, "batch", "seq", None)


def scale_axes(axes: tuple) -> tuple:
    """The logical axes of a per-row scale stack: its rows' axes without the feature axis."""
    return tuple(axes[:-1])


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where a cache's slots live when `ways` devices share its slot axis: slot s on device s % ways, at local row
    s // ways (module docstring: why strided). ways = 1 is slot order. The one mapping every writer and reader uses;
    the methods take Python ints, numpy or jax arrays alike."""

    ways: int

    def device(self, slot):
        return slot % self.ways

    def row(self, slot):
        return slot // self.ways

    def slot(self, device, row):
        return row * self.ways + device

    def filled(self, length, device):
        """Rows of `device` that hold slots < `length` (the first rows: rows grow with the slot)."""
        return (length - device + self.ways - 1) // self.ways

    def to_slots(self, a: jax.Array, axis: int = 3) -> jax.Array:
        """`a` with its slot `axis` in this layout's device-major order -> slot order."""
        return self._swap(a, axis, (self.ways, a.shape[axis] // self.ways))

    def from_slots(self, a: jax.Array, axis: int = 3) -> jax.Array:
        """Inverse of `to_slots`: slot order -> device-major (device d's rows: slots d, d + ways, ...)."""
        return self._swap(a, axis, (a.shape[axis] // self.ways, self.ways))

    def _swap(self, a, axis, split):
        if self.ways == 1:
            return a
        parts = a.reshape(*a.shape[:axis], *split, *a.shape[axis + 1:])
        return jnp.swapaxes(parts, axis, axis + 1).reshape(a.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    c_kv: tuple[jax.Array, ...]
    k_rope: tuple[jax.Array, ...]
    index_k: tuple[jax.Array, ...]
    length: jax.Array  # [] int32: tokens written so far
    # Per-row float32 scales of c_kv / index_k when they hold e4m3 values; () otherwise (module docstring).
    c_scale: tuple[jax.Array, ...] = ()
    i_scale: tuple[jax.Array, ...] = ()
    # The slot layout's ways (`SlotLayout`): the stacks' slot axis is in its device-major order. Static (part of
    # the tree structure): programs are traced for one layout. 1: slot order.
    stride: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return self.c_kv[0].shape[3]

    @property
    def batch(self) -> int:
        return self.c_kv[0].shape[2]

    @property
    def cache_dtype(self) -> str:
        """The `ModelOptions.cache_dtype` this cache was made with."""
        return cache_fp8.E4M3.name if self.c_scale else "auto"

    @property
    def layout(self) -> SlotLayout:
        return SlotLayout(self.stride)

    def relayout(self, stride: int) -> KVCache:
        """The same cache with its stacks in the slot layout of `stride` ways (1: slot order, what a cache made on
        one device holds; a test compares caches so). A permutation of each stack's slot axis."""
        if self.capacity % stride:
            raise ValueError(f"a cache of {self.capacity} slots cannot be split {stride} ways")

        def move(a):
            return SlotLayout(stride).from_slots(self.layout.to_slots(a, 3), 3)

        stacks = [tuple(map(move, group)) for group in self.stacks()]
        return KVCache(*stacks[:3], self.length, *stacks[3:], stride=stride)

    def stacks(self) -> tuple:
        """Every array the cache holds (values and scales), not `length`."""
        return self.c_kv, self.k_rope, self.index_k, self.c_scale, self.i_scale

    def nbytes(self) -> int:
        """Bytes of the whole (global) cache, scales included."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.stacks()))

    def device_nbytes(self) -> int:
        """Bytes one device holds (the largest share; the whole cache when it is not sharded)."""
        total = 0
        for a in jax.tree.leaves(self.stacks()):
            shards = getattr(a, "addressable_shards", None)
            total += max(s.data.nbytes for s in shards) if shards else a.size * a.dtype.itemsize
        return total

    # What the model's layer scan asks of a cache (`model/shared_cache.SharedCache` answers the same).
    @property
    def key_slots(self) -> int:
        """Key slots a query may select from (the top-k's index space)."""
        return self.capacity

    @property
    def next_position(self) -> jax.Array:
        """Position of the next token run against this cache."""
        return self.length

    def segment(self, s: int) -> SegmentCache:
        scales = (self.c_scale[s], self.i_scale[s]) if self.c_scale else (None, None)
        return SegmentCache(self.c_kv[s], self.k_rope[s], self.index_k[s], self.length, *scales, stride=self.stride)

    def write(self, new_c, new_r, new_i, seq: int) -> KVCache:
        return write_chunk(self, new_c, new_r, new_i, seq)


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


def slot_ways(mesh=None) -> int:
    """Devices `mesh` (default: the current mesh, if any) and the rules split the cache's slot axis over (1 outside
    a mesh)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return math.prod(mesh.shape[n] for n in slot_axes(mesh))


def slot_stride(capacity: int, mesh=None) -> int:
    """The slot layout's ways (`KVCache.stride`) of a cache of `capacity` slots made under `mesh` (default: the
    current one): the devices sharing its slot axis when they divide it, else 1 (slot order; GSPMD places the
    reads and writes of such a cache, which `slot_capacity` never makes)."""
    ways = slot_ways(mesh)
    return ways if ways > 1 and capacity % ways == 0 else 1


def init_cache(cfg: ModelConfig, segments, batch: int, capacity: int, dtype=jnp.bfloat16,
               cache_dtype: str = "auto") -> KVCache:
    """An empty cache for `batch` sequences of up to `capacity` tokens (`segments` from the model), in the
    model's `dtype`, or with e4m3 latents and indexer keys (`cache_dtype`, module docstring).

    Each array carries the cache's logical sharding: traced under a mesh (the sampler builds it
    inside jit), every device allocates only its slots, never a replicated whole cache; the slots are laid out
    strided over those devices (`slot_stride`, module docstring).
    """
    if capacity <= 0 or batch <= 0:
        raise ValueError(f"cache batch and capacity must be positive, got batch={batch} capacity={capacity}")
    return KVCache(**empty_stacks(cfg, segments, batch, capacity, dtype, CACHE_AXES, cache_dtype),
                   length=jnp.zeros((), jnp.int32), stride=slot_stride(capacity))


def empty_stacks(cfg: ModelConfig, segments, batch: int, slots: int, dtype, axes, cache_dtype: str = "auto") -> dict:
    """Zero stacks per segment, [repeats, U|F, batch, slots, *], each constrained to the logical `axes`, as
    the fields of a cache: c_kv, k_rope, index_k in `dtype`; with a quantized `cache_dtype`, c_kv and index_k
    in e4m3 plus their scale stacks [repeats, U|F, batch, slots] of ones (an all-zero row's scale), else
    c_scale = i_scale = (). The index keys are values of the parameter dtype (the indexer rounds them so), so
    storing them in it (bf16 on the real run, half of float32's bytes) loses nothing."""
    def zeros(shape, dt):
        return tuple(constrain(jnp.zeros(s, dt), axes) for s in shape)

    def ones(shape):
        return tuple(constrain(jnp.ones(s[:-1], jnp.float32), scale_axes(axes)) for s in shape)

    units = [(seg.repeats, len(seg.unit), sum(1 for kind in seg.unit if kind[1] == "full")) for seg in segments]
    latent = [(r, n, batch, slots, cfg.kv_lora_rank) for r, n, _ in units]
    keys = [(r, f, batch, slots, cfg.index_head_dim) for r, _, f in units]
    values = cache_fp8.values_dtype(cache_dtype, dtype)
    quantized = cache_fp8.quantized(cache_dtype)
    return dict(c_kv=zeros(latent, values), k_rope=zeros([(r, n, batch, slots, cfg.qk_rope_head_dim)
                                                          for r, n, _ in units], dtype),
                index_k=zeros(keys, values), c_scale=ones(latent) if quantized else (),
                i_scale=ones(keys) if quantized else ())


def cache_from_entries(new_c, new_r, new_i, seq: int, capacity: int, dtype, cache_dtype: str = "auto",
                       scales: tuple | None = None) -> KVCache:
    """A cache holding a whole prompt's entries (per segment [repeats, U|F, B, S, *], slot order)
    in slots `0 .. S-1` of `capacity`, laid out as `init_cache` + `write_chunk` would leave it (the
    latents and keys quantized per row with a quantized `cache_dtype`; strided over the current mesh's slot
    devices, `slot_stride`). `scales`: (c_scale, i_scale) when new_c / new_i already hold `cache_fp8.store_rows`'s
    e4m3 values (quantized before a re-layout, which then moves half the bytes), else None."""
    layout = SlotLayout(slot_stride(capacity))

    def fill(chunk, dt, fill_value=0):
        chunk = chunk.astype(dt)
        pad = ((0, 0),) * 3 + ((0, capacity - seq),) + ((0, 0),) * (chunk.ndim - 4)
        full = layout.from_slots(jnp.pad(chunk, pad, constant_values=fill_value), 3)
        return constrain(full, CACHE_AXES[:full.ndim])

    quantized = cache_fp8.quantized(cache_dtype)
    if scales is None:
        new_c, c_scale = cache_fp8.store_rows(new_c, quantized)
        new_i, i_scale = cache_fp8.store_rows(new_i, quantized)
    else:
        c_scale, i_scale = scales
    values = cache_fp8.values_dtype(cache_dtype, dtype)
    return KVCache(tuple(fill(a, values) for a in new_c), tuple(fill(a, dtype) for a in new_r),
                   tuple(fill(a, values) for a in new_i), jnp.asarray(seq, jnp.int32),
                   tuple(fill(a, jnp.float32, 1.0) for a in c_scale), tuple(fill(a, jnp.float32, 1.0) for a in i_scale),
                   stride=layout.ways)


@dataclasses.dataclass(frozen=True)
class LayerCacheView:
    """One layer's part of a segment's stacked cache, read in place (never sliced out).

    c_kv / k_rope: the segment's [repeats, U, B, Cap, *] stacks, `slot` = (repeat, unit slot);
    index_k: the segment's [repeats, F, B, Cap, I] stack with `index_slot` = (repeat, full slot),
    or None on a 'shared' layer. `length`: cached tokens ([] int32). c_scale [repeats, U, B, Cap] /
    i_scale [repeats, F, B, Cap]: the per-row scales of e4m3 c_kv / index_k, else None. `stride`: the
    cache's slot layout (`KVCache.stride`).
    """

    c_kv: jax.Array
    k_rope: jax.Array
    index_k: jax.Array | None
    slot: tuple
    index_slot: tuple | None
    length: jax.Array
    c_scale: jax.Array | None = None
    i_scale: jax.Array | None = None
    stride: int = 1

    @property
    def capacity(self) -> int:
        return self.c_kv.shape[-2]


@dataclasses.dataclass(frozen=True)
class SegmentCache:
    """One segment's stacks of a `KVCache` (read in place by the segment's layer scan) and its `length`."""

    c_kv: jax.Array  # [repeats, U, B, Cap, C]
    k_rope: jax.Array  # [repeats, U, B, Cap, R]
    index_k: jax.Array  # [repeats, F, B, Cap, I]
    length: jax.Array
    c_scale: jax.Array | None = None  # [repeats, U, B, Cap] with an e4m3 c_kv
    i_scale: jax.Array | None = None  # [repeats, F, B, Cap] with an e4m3 index_k
    stride: int = 1  # `KVCache.stride`

    def layer(self, rep, slot: int, full_slot: int | None) -> LayerCacheView:
        """The view of unit layer `slot` at repeat `rep`; `full_slot`: its index among the unit's
        'full' layers, None on a 'shared' layer (no indexer keys)."""
        full = full_slot is not None
        return LayerCacheView(self.c_kv, self.k_rope, self.index_k if full else None, (rep, slot),
                              (rep, full_slot) if full else None, self.length, self.c_scale,
                              self.i_scale if full else None, self.stride)


def write_chunk(cache: KVCache, new_c, new_r, new_i, seq: int) -> KVCache:
    """Writes a chunk's entries (per segment [repeats, U|F, B, S, *]) at slot `length`; length += S.
    A quantized cache stores the latents and keys as e4m3 rows and their scales (`cache_fp8.store_rows`).

    One `dynamic_update_slice` per stacked array: under jit, with the cache in a loop carry or
    donated, XLA updates it in place instead of copying the whole cache per layer. A strided cache
    (`cache.stride` > 1) is written per device, each updating its own rows (`_write_sharded`).
    """
    layout = cache.layout
    axes = check_slot_mesh(layout.ways)

    def put(stack, chunk):
        chunk = chunk.astype(stack.dtype)
        if layout.ways > 1:
            updated = _write_sharded(stack, chunk, cache.length, axes, layout)
        else:
            # Slot order: one device, or a capacity the slot shards do not divide (the sampler never makes one:
            # `slot_capacity`): correct, but GSPMD may gather the stack around the update under a mesh.
            updated = jax.lax.dynamic_update_slice(stack, chunk, (0, 0, 0, cache.length) + (0,) * (stack.ndim - 4))
        # The sequence axis stays sharded (context parallel) under a mesh; a no-op without one.
        return constrain(updated, CACHE_AXES[:stack.ndim])

    quantized = bool(cache.c_scale)
    new_c, c_scale = cache_fp8.store_rows(new_c, quantized)
    new_i, i_scale = cache_fp8.store_rows(new_i, quantized)
    return KVCache(tuple(map(put, cache.c_kv, new_c)), tuple(map(put, cache.k_rope, new_r)),
                   tuple(map(put, cache.index_k, new_i)), cache.length + seq,
                   tuple(map(put, cache.c_scale, c_scale)), tuple(map(put, cache.i_scale, i_scale)),
                   stride=cache.stride)


def slot_axes(mesh=None) -> tuple[str, ...]:
    """Mesh axes (of size > 1) `mesh` (default: the current mesh) and the rules shard the cache's slot axis over;
    () outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
        return ()
    part = logical_to_spec(CACHE_AXES, mesh_axes=mesh.axis_names)[3]
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return tuple(n for n in names if mesh.shape[n] > 1)


def check_slot_mesh(stride: int) -> tuple[str, ...]:
    """The slot axes of the current mesh for a cache laid out `stride` ways; a ValueError when they are not
    `stride` devices (the cache was made under another mesh: its rows would be read from the wrong slots)."""
    if stride == 1:
        return ()
    axes = slot_axes()
    if slot_ways() != stride:
        raise ValueError(f"a KV cache laid out over {stride} slot shards is used where the mesh splits slots "
                         f"{slot_ways()} ways; use it under the mesh it was made on, or convert it with "
                         f"cache.relayout({slot_ways()})")
    return axes


def _write_sharded(stack: jax.Array, chunk: jax.Array, length: jax.Array, axes: tuple[str, ...],
                   layout: SlotLayout) -> jax.Array:
    """`stack: [reps, U|F, B, Cap, *]` with slots laid out by `layout` over `axes`, `chunk: [reps, U|F, B, S, *]`
    (same dtype) written at global slots `length ..`, each device touching only its own rows. `*` is the
    feature axis, or none for a scale stack.

    A `dynamic_update_slice` at a traced offset on a sharded axis makes GSPMD all-gather the whole
    stack on every device, and a select over the stack rewrites every slot of every layer each
    step; inside a shard_map over the slot axes each device instead reads and rewrites one window
    of its shard in place (`_write_local`). Other mesh axes (the batch's) stay automatic.
    """
    slots = P(None, None, None, axes, *(None,) * (stack.ndim - 4))

    def local(stack, chunk, length):
        return _write_local(stack, chunk, length, jax.lax.axis_index(axes), layout)

    return jax.shard_map(local, in_specs=(slots, P(), P()), out_specs=slots, axis_names=frozenset(axes))(
        stack, chunk, length)


def _write_local(shard: jax.Array, chunk: jax.Array, length: jax.Array, device: jax.Array,
                 layout: SlotLayout) -> jax.Array:
    """One device's part of a chunk write: `shard: [reps, U|F, B, Cap_local, *]` holds the rows of `device`
    (`layout`); `chunk: [reps, U|F, B, S, *]` goes to global slots `length .. length + S - 1`, of which this
    device holds at most ceil(S / ways), at consecutive local rows from `layout.filled(length, device)`.

    The update is a window of W = min(ceil(S / ways), Cap_local) local rows placed to cover them: read
    (`dynamic_slice`), chunk rows put where they land, written back (`dynamic_update_slice`) at the same
    offset, so XLA updates the shard in place and the select only spans W rows. Rows of the window outside
    the chunk keep their values.
    """
    local_cap, seq = shard.shape[3], chunk.shape[3]
    window = min(-(-seq // layout.ways), local_cap)
    start = jnp.clip(layout.filled(length, device), 0, local_cap - window)
    # The chunk row that lands on each window row: its global slot minus `length`.
    rows = layout.slot(device, start + jnp.arange(window, dtype=jnp.int32)) - length
    lands = (rows >= 0) & (rows < seq)
    incoming = jnp.take(chunk, rows, axis=3, mode="clip")  # rows that do not land are masked below
    current = jax.lax.dynamic_slice_in_dim(shard, start, window, axis=3)
    update = jnp.where(lands.reshape(window, *(1,) * (shard.ndim - 4)), incoming, current)
    return jax.lax.dynamic_update_slice_in_dim(shard, update, start, axis=3)
