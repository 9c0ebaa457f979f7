"""Context-parallel DSA for whole-sequence forwards (training, uncached prefill).

Queries stay sharded over the mesh axes the `seq` rule names; inside a `jax.shard_map` each device
all-gathers only the key side of a layer (latent c_kv C + rope key R + indexer key I per token),
scores its own queries against every causal key with the streaming top-k (so the global top-k is
exact, not merged from approximations) and attends to its selected rows. The all-gather's
transpose (a reduce-scatter) carries the key-side gradients back to their owners.

Layout: causal work per query grows with its position, so contiguous shards leave the first
device almost idle and the last one with ~2x the mean (benchmarks/cp_balance.py). The `zigzag`
layout cuts the sequence into 2N chunks and gives device i chunks i and 2N-1-i: the model runs
on the permuted sequence (ids and positions permuted on entry, hidden states back on exit) and
the gathered keys are put back in sequence order, where the streaming top-k's causal block
skipping works. The length is padded to a multiple of 2N with tokens at later positions, which
no real query can see.

Axis letters: B batch, S sequence (local inside shard_map), L padded length, C kv_lora, R rope,
I indexer dim, H heads, K top-k, N devices on the sequence axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm52_jax.kernels.sparse_mla import encode_rows, sparse_mla_tables
from glm52_jax.model.indexer import INVALID, cached_topk, merge_topk, streaming_topk
from glm52_jax.model.kv_cache import SlotLayout, check_slot_mesh
from glm52_jax.model.sparse_attention import CachedRows, array_rows, pallas_interpret, sparse_mla_rows
from glm52_jax.parallel.rules import constrain, logical_to_spec

LAYOUTS = ("zigzag", "contiguous", "off")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A whole-sequence CP plan: `axes` (mesh axes of `seq`, `ways` devices), `layout`, real
    length `seq` and padded length `padded`."""

    axes: tuple[str, ...]
    ways: int
    layout: str
    seq: int
    padded: int

    @property
    def chunks(self) -> int:
        return 2 * self.ways if self.layout == "zigzag" else self.ways


def seq_axes(mesh) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that the active rules give the `seq` logical axis."""
    part = logical_to_spec(("seq",), mesh_axes=mesh.axis_names)[0]
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return tuple(n for n in names if mesh.shape[n] > 1)


def plan_layout(seq: int, layout: str, mesh=None) -> Layout | None:
    """The CP layout for a whole-sequence forward of `seq` tokens, or None (no mesh, the sequence
    is not sharded, or `layout="off"`: GSPMD places the attention)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context_parallel: expected one of {LAYOUTS}, got {layout!r}")
    if layout == "off":
        return None
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        return None
    axes = seq_axes(mesh)
    if not axes:
        return None
    ways = math.prod(mesh.shape[a] for a in axes)
    chunks = 2 * ways if layout == "zigzag" else ways
    return Layout(axes, ways, layout, seq, -(-seq // chunks) * chunks)


_active: list[Layout | None] = [None]


@contextlib.contextmanager
def active(layout: Layout | None):
    """Makes `layout` the one attention layers traced inside use (trace-time, like axis rules)."""
    _active.append(layout)
    try:
        yield layout
    finally:
        _active.pop()


def current() -> Layout | None:
    return _active[-1]


# -- sequence order <-> device layout (static permutations of whole chunks) -----------------------

def to_layout(x: jax.Array, lay: Layout, axis: int = 1) -> jax.Array:
    """Sequence order (length `padded` on `axis`) -> the layout's order (device-major)."""
    if lay.layout != "zigzag":
        return x
    x = jnp.moveaxis(x, axis, 0)
    n = lay.ways
    chunks = x.reshape(2 * n, x.shape[0] // (2 * n), *x.shape[1:])  # explicit: x may be empty
    pairs = jnp.stack([chunks[:n], chunks[n:][::-1]], axis=1)  # device i: chunks i and 2n-1-i
    return jnp.moveaxis(pairs.reshape(x.shape), 0, axis)


def from_layout(x: jax.Array, lay: Layout, axis: int = 1) -> jax.Array:
    """Inverse of `to_layout`."""
    if lay.layout != "zigzag":
        return x
    x = jnp.moveaxis(x, axis, 0)
    n = lay.ways
    pairs = x.reshape(n, 2, x.shape[0] // (2 * n), *x.shape[1:])
    chunks = jnp.concatenate([pairs[:, 0], pairs[:, 1][::-1]], axis=0)
    return jnp.moveaxis(chunks.reshape(x.shape), 0, axis)


# A whole-sequence forward with more than this many tokens per device (the 2M prompt's whole prefill: 262,144 on 8
# devices) runs its per-token work that would hold [tokens, heads, ...] or [tokens, intermediate] temporaries in
# blocks of this many per device: the attention q_b .. o_proj (`mla.Attention._whole_in_blocks`) and the dense
# SwiGLU MLPs (`moe.MLP`). Shorter ones (training, parity, tests) run at once.
WHOLE_QUERY_BLOCK = 16_384


def whole_blocks(length: int, ways: int) -> int:
    """Blocks of a whole-sequence CP forward of `length` (padded) tokens on `ways` devices: 1 (unblocked) unless
    each device holds more than `WHOLE_QUERY_BLOCK` tokens and a whole number of blocks of it."""
    local = length // ways
    if local <= WHOLE_QUERY_BLOCK or local % WHOLE_QUERY_BLOCK:
        return 1
    return local // WHOLE_QUERY_BLOCK


def split_blocks(a: jax.Array, axis: int, ways: int, blocks: int) -> jax.Array:
    """`a: [.., L, ..]` in a layout's order (device-major, L on `axis` sharded `ways` ways) -> [blocks, .., L /
    blocks, ..]: block j holds every device's j-th run of L / (ways x blocks) tokens, so it stays sharded alike
    (reshapes and a transpose of each device's own rows; nothing moves between devices)."""
    length = a.shape[axis]
    a = a.reshape(*a.shape[:axis], ways, blocks, length // (ways * blocks), *a.shape[axis + 1:])
    a = jnp.moveaxis(a, axis + 1, 0)
    return a.reshape(blocks, *a.shape[1:axis + 1], length // blocks, *a.shape[axis + 3:])


def join_blocks(a: jax.Array, axis: int, ways: int, blocks: int) -> jax.Array:
    """Inverse of `split_blocks` (`axis` counted without the leading block axis)."""
    length = a.shape[axis + 1] * blocks
    a = a.reshape(blocks, *a.shape[1:axis + 1], ways, length // (ways * blocks), *a.shape[axis + 2:])
    a = jnp.moveaxis(a, 0, axis + 1)
    return a.reshape(*a.shape[:axis], length, *a.shape[axis + 3:])


def pad_sequence(ids: jax.Array, positions: jax.Array, lay: Layout) -> tuple[jax.Array, jax.Array]:
    """`ids: [B,S]`, `positions: [S]` padded to `lay.padded`; pads sit after every real token."""
    extra = lay.padded - lay.seq
    if not extra:
        return ids, positions
    ids = jnp.pad(ids, ((0, 0), (0, extra)))
    tail = positions[-1] + 1 + jnp.arange(extra, dtype=positions.dtype)
    return ids, jnp.concatenate([positions, tail])


# -- the attention core --------------------------------------------------------------------------

def _gather_in_order(x, lay: Layout, axis: int):
    """Inside a shard_map over `lay.axes`: every device's shard of `x`, back in sequence order."""
    return from_layout(jax.lax.all_gather(x, lay.axes, axis=axis, tiled=True), lay, axis=axis)


def _gathered_keys(lay: Layout, c_kv, k_rope, positions, index_k):
    """Inside a shard_map: (key positions, index keys or None, c_kv, k_rope), all of them in sequence order."""
    return (_gather_in_order(positions, lay, 0), None if index_k is None else _gather_in_order(index_k, lay, 1),
            _gather_in_order(c_kv, lay, 1), _gather_in_order(k_rope, lay, 1))


def gather_key_side(lay: Layout, c_kv, k_rope, positions, index_k=None):
    """Every device's key side in sequence order, replicated (what `cp_sparse_attention` gathers per call): (key
    positions [L], index keys [B,L,I] or None, c_kv [B,L,C], k_rope [B,L,R]) from their layout-ordered shards. A
    caller that attends several query blocks to the same keys gathers them once (`mla.Attention._whole_in_blocks`:
    the 2M prefill's 4 blocks per layer gathered the 2 GiB latent stack 4 times)."""
    axes = lay.axes
    seq_spec, pos_spec = P(None, axes), P(axes)

    def per_device(c_kv, k_rope, positions, index_k):
        return _gathered_keys(lay, c_kv, k_rope, positions, index_k)

    fn = jax.shard_map(per_device, in_specs=(seq_spec, seq_spec, pos_spec, None if index_k is None else seq_spec),
                       out_specs=P(), axis_names=frozenset(axes), check_vma=False)  # every device: the same keys
    return fn(c_kv, k_rope, positions, index_k)


def cp_sparse_attention(lay: Layout, q_lat, q_rope, c_kv, k_rope, positions, index, prev_topk, *,
                        index_topk: int, index_scale: float, softmax_scale: float, indexer_blocks: dict,
                        attention_query_block: int, kernels: str = "reference", q_positions=None, keys=None):
    """Sparse MLA of sharded queries over all-gathered keys, in the layout's order.

    q_lat: [B,L,H,C], q_rope: [B,L,H,R], c_kv: [B,L,C], k_rope: [B,L,R], positions: [L] (all in
    layout order, sharded on `lay.axes`); index: (iq [B,L,Hi,I], iw [B,L,Hi], ik [B,L,I]) for a
    layer with its own indexer, else None and `prev_topk: [B,L,K]`. `indexer_blocks`: the indexer's
    block sizes, kernels and score dtype (`streaming_topk` keywords). Returns (out_lat [B,L,H,C],
    top-k [B,L,K] of key indices in sequence order). With `q_positions: [Q]` (sharded like `positions`)
    the query side (q_lat, q_rope, iq, iw, prev_topk) is Q tokens at those positions, a block of each
    device's queries (`mla.Attention._whole_in_blocks`), and the key side is still all L tokens; `keys`: that key
    side already gathered (`gather_key_side`; c_kv, k_rope and the index's keys are then not read).
    """
    axes = lay.axes
    seq_spec = P(None, axes)
    pos_spec = P(axes)

    def per_device(q_lat, q_rope, c_kv, k_rope, positions, index, prev_topk, q_positions, keys):
        if keys is None:
            keys = _gathered_keys(lay, c_kv, k_rope, positions, None if index is None else index[2])
        key_pos, all_ik, all_c_kv, all_k_rope = keys
        if index is not None:
            iq, iw, _ = index
            topk = streaming_topk(iq, iw, all_ik, positions if q_positions is None else q_positions,
                                  key_pos, index_topk, scale=index_scale, **indexer_blocks)
        else:
            topk = prev_topk
        rows = array_rows(all_c_kv, all_k_rope)
        out = sparse_mla_rows(q_lat, q_rope, rows, topk, scale=softmax_scale, query_block=attention_query_block,
                              kernels=kernels)
        return out, topk

    index_specs = None if index is None else (seq_spec, seq_spec, seq_spec)
    topk_spec = None if prev_topk is None else seq_spec
    fn = jax.shard_map(per_device, in_specs=(seq_spec, seq_spec, seq_spec, seq_spec, pos_spec, index_specs, topk_spec,
                                             None if q_positions is None else pos_spec, None if keys is None else P()),
                       out_specs=(seq_spec, seq_spec), axis_names=frozenset(axes),
                       # The indexer's and attention's loops start from constants; every input and
                       # output is sharded on `axes` (or, gathered keys, replicated), so varying-axis typing adds
                       # nothing here.
                       check_vma=False)
    return fn(q_lat, q_rope, c_kv, k_rope, positions, index, prev_topk, q_positions, keys)


# -- chunks against a sequence-sharded cache (decode, prefill chunks) --------------------------------

# A cached chunk's queries go through the explicit path below this many (batch x chunk) at a time: every
# device holds all of a block's query-side tensors and [B,S,N*K] top-k candidates. Longer chunks (a prefill
# chunk of 16K after a prefix-cache hit) run as a loop over query blocks, still scoring each device's own slots.
MAX_CACHED_QUERIES = 256


def cached_layout(stride: int) -> tuple[tuple[str, ...], SlotLayout] | None:
    """(slot mesh axes, slot layout) when a cached chunk runs `cp_cached_attention`: its cache is laid out over the
    current mesh's slot shards (`KVCache.stride` > 1; `kv_cache.check_slot_mesh` refuses another mesh). None for a
    slot-ordered cache (one device; GSPMD places the reads). Any chunk length: long chunks loop over query blocks.
    Not `ModelOptions.context_parallel`: a strided cache has only this reader."""
    if stride == 1:
        return None
    return check_slot_mesh(stride), SlotLayout(stride)


def cp_cached_attention(sharded: tuple[tuple[str, ...], SlotLayout], q_lat, q_rope, c_new, r_new, positions, cache,
                        index, prev_topk, *, index_topk: int, index_scale: float, softmax_scale: float,
                        indexer_blocks: dict, kernels: str = "reference"):
    """A chunk's sparse MLA over a cache whose slots are laid out over `sharded = (axes, layout)` (`cached_layout`;
    see `_cp_cached_block`), for any chunk length: chunks of more than `MAX_CACHED_QUERIES` queries (batch x chunk)
    run in query blocks (a `lax.map`; the last block padded with copies of the last query), each against the whole
    chunk's own keys, so no device ever holds the cache's key stack. Same arguments and results as
    `_cp_cached_block`."""
    batch, seq = q_lat.shape[:2]
    if batch * seq <= MAX_CACHED_QUERIES:
        return _cp_cached_block(sharded, q_lat, q_rope, c_new, r_new, positions, positions, cache, index, prev_topk,
                                index_topk=index_topk, index_scale=index_scale, softmax_scale=softmax_scale,
                                indexer_blocks=indexer_blocks, kernels=kernels)
    block = max(1, MAX_CACHED_QUERIES // batch)
    blocks = -(-seq // block)
    pad = blocks * block - seq

    def split(a, axis):  # [.., S, ..] -> [blocks, .., block, ..], padded by repeating the last query
        # Replicated once here: a loop slicing a sequence-sharded array would all-gather all of it per block
        # (the 2M plan's prefill tail: a 1.07 GB query tensor gathered 64 times per layer).
        a = constrain(a, (None,) * a.ndim)
        a = jnp.concatenate([a, jnp.repeat(jax.lax.slice_in_dim(a, seq - 1, seq, axis=axis), pad, axis)], axis)
        a = a.reshape(*a.shape[:axis], blocks, block, *a.shape[axis + 1:])
        return jnp.moveaxis(a, axis, 0)

    iq_iw = None if index is None else (split(index[0], 1), split(index[1], 1))
    xs = (split(q_lat, 1), split(q_rope, 1), split(positions, 0), iq_iw,
          None if prev_topk is None else split(prev_topk, 1))

    def one(args):
        ql, qr, qpos, qi, prev = args
        blk_index = None if index is None else (*qi, index[2])
        return _cp_cached_block(sharded, ql, qr, c_new, r_new, qpos, positions, cache, blk_index, prev,
                                index_topk=index_topk, index_scale=index_scale, softmax_scale=softmax_scale,
                                indexer_blocks=indexer_blocks, kernels=kernels)

    out, topk = jax.lax.map(one, xs)
    join = lambda a: jnp.moveaxis(a, 0, 1).reshape(batch, blocks * block, *a.shape[3:])[:, :seq]  # noqa: E731
    return join(out), join(topk)


def _cp_cached_block(sharded: tuple[tuple[str, ...], SlotLayout], q_lat, q_rope, c_new, r_new, q_positions,
                     positions, cache, index, prev_topk, *, index_topk: int, index_scale: float, softmax_scale: float,
                     indexer_blocks: dict, kernels: str = "reference"):
    """A chunk's sparse MLA over a cache whose slots are laid out by `layout` over the mesh axes `axes` (`sharded`).

    Each device scores only its own cache slots with the indexer; the per-device candidates are
    all-gathered and merged with the chunk's own keys into the exact global top-k; each device
    attends to the selected keys it holds (cache rows in its slots, and chunk rows whose slots it
    will own) and the partial softmax results are combined with a log-sum-exp. With the slots strided
    (`kv_cache.SlotLayout`) every device scores ceil or floor of length / N slots.

    q_lat: [B,Q,H,C], q_rope: [B,Q,H,R] (Q queries at `q_positions: [Q]`, the whole chunk or a block of it);
    c_new: [B,S,C], r_new: [B,S,R] the whole chunk's own rows at `positions: [S]`; cache: a `LayerCacheView`
    (stacks [reps, U|F, B, Cap, *]; an FP8 cache's scale stacks [reps, U|F, B, Cap] are sharded like their rows
    and read with them); index: (iq [B,Q,..], iw [B,Q,..], ik_new [B,S,..]) for a layer with its
    own indexer, else None and `prev_topk: [B,Q,K]` (global slots). `kernels` (`ModelOptions.kernels`): whether each
    device's attention runs on the sparse MLA kernel (`lse_attention`). Returns (out_lat [B,Q,H,C], top-k [B,Q,K]
    global slots), replicated over `axes`.
    """
    axes, layout = sharded
    replicated = P()
    slots = P(None, None, None, axes, None)
    scale_slots = P(None, None, None, axes)
    capacity = cache.c_kv.shape[-2]
    topk_k = min(index_topk, capacity)
    dtype = q_lat.dtype  # the kernel's query dtype (the shard_map takes float32 copies; see below)

    def per_device(q_lat, q_rope, c_new, r_new, q_positions, positions, cache_c, cache_r, cache_i, slot, index_slot,
                   length, index, prev_topk, cache_cs, cache_is):
        me = jax.lax.axis_index(axes)
        if index is not None:
            iq, iw, ik_new = index
            vals, idx = cached_topk(iq, iw, cache_i, index_slot, q_positions, layout.filled(length, me), index_topk,
                                    scale=index_scale, key_scales=cache_is, **indexer_blocks)
            topk = merge_topk(gather_candidates(vals, layout.slot(me, idx), idx >= 0, axes),
                              _own_candidates(iq, iw, ik_new, q_positions, positions, length, index_topk, index_scale,
                                              indexer_blocks), topk_k, ties="slot")
        else:
            topk = prev_topk
        out = _partial_attention(q_lat, q_rope, topk, cache_c, cache_r, slot, c_new, r_new, length, me, layout,
                                 softmax_scale, axes, cache_cs, kernels=kernels, dtype=dtype)
        return out, topk

    index_specs = None if index is None else (replicated,) * 3
    topk_spec = None if prev_topk is None else replicated
    has_index = cache.index_k is not None
    quantized = cache.c_scale is not None
    fn = jax.shard_map(
        per_device,
        in_specs=(replicated,) * 6 + (slots, slots, slots if has_index else None, replicated,
                                      replicated if has_index else None, replicated, index_specs, topk_spec,
                                      scale_slots if quantized else None,
                                      scale_slots if quantized and has_index else None),
        out_specs=(replicated, replicated), axis_names=frozenset(axes), check_vma=False)
    # The chunk's tensors enter replicated, so their cotangents are summed over `axes` in the
    # backward; in float32 (they are small: <= MAX_CACHED_QUERIES rows), which also keeps XLA:CPU's
    # bf16 all-reduce promotion (which aborts on these reductions) out of the program.
    f32 = [a.astype(jnp.float32) for a in (q_lat, q_rope, c_new, r_new)]
    out, topk = fn(*f32, q_positions, positions, cache.c_kv, cache.k_rope, cache.index_k, cache.slot,
                   cache.index_slot, cache.length, index, prev_topk, cache.c_scale,
                   cache.i_scale if has_index else None)
    return out.astype(q_lat.dtype), topk


def _own_candidates(iq, iw, ik_new, q_positions, positions, length, index_topk, index_scale, indexer_blocks):
    """The chunk's own keys' top-k candidates (scores, global slots `length + i`) [B,Q,k]: the same on every device."""
    vals, idx = streaming_topk(iq, iw, ik_new, q_positions, positions, index_topk, scale=index_scale,
                               return_scores=True, **indexer_blocks)
    return vals, jnp.where(idx >= 0, idx + length, idx)


def gather_candidates(vals: jax.Array, slots: jax.Array, valid: jax.Array, axes) -> tuple[jax.Array, jax.Array]:
    """Every device's top-k candidates `vals`, `slots: [B,S,k]` (global slots where `valid`) all-gathered over
    `axes`: [B,S,N*k], INVALID where not valid. Devices hold interleaved slots, so the concatenation is not in slot
    order: merge with `merge_topk(..., ties="slot")`."""
    slots = jnp.where(valid, slots, INVALID)
    return tuple(jnp.moveaxis(jax.lax.all_gather(a, axes), 0, 2).reshape(*a.shape[:2], -1) for a in (vals, slots))


# Selected keys are attended in blocks of this many; a device runs only the blocks that hold keys it keeps
# (`lse_attention`): with the slots strided, about K/N of a query's K selected keys, not all K.
KEY_BLOCK = 256


class StridedRows(CachedRows):
    """`CachedRows` over one device's shard of a cache laid out by `layout` (`kv_cache.SlotLayout`): a selected
    global slot below `length` is read from this device's local row `layout.row(slot)` of the stacks (in place:
    the kernels' table A is the local stack flattened, `CachedRows.tables`), a later one from the chunk's rows
    (table B). Slots another device holds map to some local row; the caller masks them (`keep`)."""

    def __init__(self, layout: SlotLayout, cache_c, cache_r, index: tuple, length, new_c, new_r, c_scale=None):
        super().__init__(cache_c, cache_r, index, length, new_c, new_r, c_scale)
        self.layout = layout

    def _slots(self, idx):
        b, in_cache, _, new = super()._slots(idx)
        return b, in_cache, jnp.clip(self.layout.row(idx), 0, self.cache_c.shape[-2] - 1), new


def _partial_attention(q_lat, q_rope, topk, cache_c, cache_r, slot, c_new, r_new, length, me, layout: SlotLayout,
                       scale, axes, cache_cs=None, kernels: str = "reference", dtype=None):
    """Softmax attention over the selected keys device `me` holds (`layout`: cache rows of its slots, chunk rows
    whose slots it will own), combined across `axes` by `lse_attention` (`kernels`, `dtype`: its keywords). With an
    FP8 cache (`cache_cs`: the local e4m3 rows' scales) only the selected rows are dequantized (gathered, or loaded by
    the kernel)."""
    mine = (topk >= 0) & (layout.device(topk) == me)
    rows = StridedRows(layout, cache_c, cache_r, slot, length, c_new, r_new, cache_cs)
    return lse_attention(q_lat, q_rope, rows, topk, mine, scale, axes, kernels=kernels, dtype=dtype)


def own_first(topk: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`topk`, `keep: [B,S,K]` reordered per query so the kept keys come first (stable), and the most keys
    any query keeps ([] int32): the key blocks past it hold nothing this device attends."""
    order = jnp.argsort(~keep, axis=-1, stable=True)
    return (jnp.take_along_axis(topk, order, -1), jnp.take_along_axis(keep, order, -1),
            jnp.max(jnp.sum(keep, axis=-1, dtype=jnp.int32), initial=0))


def lse_attention(q_lat, q_rope, rows, topk, keep, scale, axes, key_block: int | None = None,
                  kernels: str = "reference", dtype=None):
    """Softmax attention of `q_lat: [B,S,H,C]`, `q_rope: [B,S,H,R]` over the selected slots `topk: [B,S,K]`
    this device keeps (`keep: [B,S,K]`), combined across `axes` by log-sum-exp:
    out = sum_d exp(m_d - M) o_d / sum_d exp(m_d - M) l_d (each selected key kept on exactly one device).

    Only this device's keys are attended: each query's kept keys are moved to the front (`own_first`) and
    taken in blocks of `key_block` (default `KEY_BLOCK`); a block past the most keys any query keeps is skipped
    (a `lax.cond`), so a device reads and scores about the keys it holds, not all K per query. `rows(idx:
    [B,S,k])` gives the selected rows (kv [B,S,k,C], kr [B,S,k,R]); it is called for the blocks that run only.
    Every block is a partial softmax of its own, merged with the others and the other devices' by the same
    combine, whose all-reduces are [B,S,H] and [B,S,H,C] float32 whatever K is.

    When `kernels` selects the Pallas kernels (`sparse_attention.pallas_interpret`) and `rows` is read in place
    (a `CachedRows`, an FP8 cache's included: the kernel dequantizes its e4m3 rows with `rows.kv_scales()`), each
    block runs `sparse_mla_tables` over `rows.tables(dtype)` (this device's cache stack and the chunk's rows, in
    place) with the keys it does not keep masked, on queries cast to `dtype` (default q_lat's: the callers hold
    float32 copies of model-dtype queries); its (normalized output, log-sum-exp) is the partial (m = lse, l = 1,
    o = out)."""
    interpret = pallas_interpret(kernels, q_lat, q_rope) if getattr(rows, "in_place", False) else None
    k = topk.shape[-1]
    kb = min(KEY_BLOCK if key_block is None else key_block, k)
    blocks = -(-k // kb)
    pad = blocks * kb - k
    topk, keep, most = own_first(topk, keep)
    if pad:
        topk = jnp.pad(topk, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
        keep = jnp.pad(keep, ((0, 0), (0, 0), (0, pad)))
    lead = topk.shape[:2]
    split = lambda a: jnp.moveaxis(a.reshape(*lead, blocks, kb), 2, 0)  # noqa: E731  [blocks,B,S,kb]
    heads, width = q_lat.shape[2], q_lat.shape[3]

    def empty():
        return (jnp.full((*lead, heads), -jnp.inf, jnp.float32), jnp.zeros((*lead, heads), jnp.float32),
                jnp.zeros((*lead, heads, width), jnp.float32))

    def gathered(idx, kept):  # one block's partial softmax: (max, sum, unnormalized output)
        kv, kr = (a.astype(q_lat.dtype) for a in rows(idx))
        logits = jnp.einsum("bshc,bskc->bshk", q_lat, kv, preferred_element_type=jnp.float32)
        logits = (logits + jnp.einsum("bshr,bskr->bshk", q_rope, kr, preferred_element_type=jnp.float32)) * scale
        kept = kept[:, :, None, :]
        # The combine is exact for any shift, so the shift carries no gradient.
        m = jax.lax.stop_gradient(jnp.max(jnp.where(kept, logits, -jnp.inf), axis=-1))  # [B,S,H]; -inf: none
        # Mask before the exp: a key that is not kept may sit far above the kept maximum, and exp of it
        # (inf) would turn the zero cotangent of the masked branch into NaN in the backward pass.
        p = jnp.exp(jnp.where(kept, logits - jnp.where(jnp.isfinite(m), m, 0.0)[..., None], -jnp.inf))
        o = jnp.einsum("bshk,bskc->bshc", p.astype(kv.dtype), kv, preferred_element_type=jnp.float32)
        return m, jnp.sum(p, axis=-1), o

    if interpret is not None:
        q_k, qr_k = (a if dtype is None else a.astype(dtype) for a in (q_lat, q_rope))
        # Once, outside the loop: the chunk's rows cast to the cache dtype (table B; an FP8 cache's: the queries').
        tables, kv_scales = rows.tables(q_k.dtype), rows.kv_scales()

    def kernel(idx, kept):  # the kernel's (out, lse) of one block as a partial softmax
        codes = encode_rows(rows.row_ids(jnp.where(kept, idx, 0)), kept)
        out, lse = sparse_mla_tables(q_k, qr_k, *tables, codes, scale=scale, interpret=interpret,
                                     kv_scales=kv_scales)
        # A query keeping no key of this block gets the kernel's finite masked average (lse ~ -1e30): weight 0.
        some = jnp.any(kept, axis=-1)[..., None]  # [B,S,1]
        return (jnp.where(some, lse, -jnp.inf), jnp.broadcast_to(some, lse.shape).astype(jnp.float32),
                jnp.where(some[..., None], out.astype(jnp.float32), 0.0))

    attend = gathered if interpret is None else kernel

    def one(_, args):
        j, idx, kept = args
        return None, jax.lax.cond(j * kb < most, attend, lambda *_: empty(), idx, kept)

    _, (m, l, o) = jax.lax.scan(one, None, (jnp.arange(blocks), split(topk), split(keep)))  # [blocks,B,S,H,..]
    # The kernel's m (its lse) carries a gradient; the shift M does not need one (the combine is exact for any).
    m_all = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(m, axis=0)), axes)
    m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    w = jnp.exp(m - m_all)  # [blocks,B,S,H]: 0 for an empty block
    denom = jax.lax.psum(jnp.sum(w * l, axis=0), axes)  # [B,S,H]
    num = jax.lax.psum(jnp.sum(w[..., None] * o, axis=0), axes)
    return jnp.where(denom[..., None] > 0, num / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0).astype(q_lat.dtype)
