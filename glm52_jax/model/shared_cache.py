"""One prompt cache shared by every sample, plus a small per-sample suffix cache.

G samples of one prompt decode against ONE batch-1 prompt cache (`KVCache`, read only, never copied
per sample: at 2M tokens it is ~6.6 GB per device on 32 devices) and a `SuffixCache` of the tokens
each sample generated ([G, R_cap] slots per layer, R_cap = new tokens: small). The response_only
update and the new log-probs run the G responses the same way, with an empty suffix.

Key slots keep the layout a G-row copy of the prompt cache would have: prompt tokens at slots
0 .. L-1 (L = the prompt cache's `length`), a sample's j-th suffix token at slot L + j. So top-k
indices, causality and ties (lowest slot first: prompt slots before suffix slots) are those of the
broadcast layout, and the results equal it up to float rounding.

Per layer and chunk (S tokens per row, all rows at the same positions L + n .. L + n + S - 1, n the
suffix's `length`):
  indexer    the G*S queries score the shared prompt slots as the queries of ONE batch row (they sit
             at the same positions, so causality is the same for all), then each row's own suffix
             slots with the chunk placed after them; the two candidate lists merge into the exact
             top-k (`indexer.merge_topk`: ties keep the prompt's entries).
  attention  the selected rows come from two tables, the prompt stack read in place (batch index 0
             for every row) and the row's suffix + chunk (`sparse_attention.CachedRows`).
  write      after the layer scan, the chunk's entries go into the suffix at slot n
             (`dynamic_update_slice`; in place when the suffix is a loop carry or donated). The
             prompt cache is never written.

Under a mesh that shards the prompt's slots (context parallel), each device scores only the prompt
slots it holds, the candidates are all-gathered and merged with the suffix candidates, and each
device attends to the selected rows it owns; the partial softmaxes combine by log-sum-exp
(`context_parallel.lse_attention`), as `context_parallel.cp_cached_attention` does for a chunk
against its own cache. The suffix is replicated over the slot axes (`SUFFIX_AXES`): it is small
(G x R_cap rows per layer), every device needs every row of it for the merge, and the chunk's
entries are computed replicated there anyway, so the write needs no communication. A selected
suffix row is owned by the device its slot would sit on in the prompt's strided slot layout
(`kv_cache.SlotLayout`), so each row counts once in the combine.

With an FP8 cache (`model/cache_fp8.py`) both the prompt cache and the suffix hold e4m3 latents and keys
with per-row scales: the prompt's selected rows are gathered with their scales and dequantized, the prompt's
keys dequantized one block at a time by the indexer; the suffix (G x Rc rows per layer, small) is
dequantized per layer before the chunk's own rows, which are attended as computed, are placed after it.

Axis letters: G rows (samples), S chunk tokens per row, Cap prompt slots, Rc suffix slots,
Rs = Rc + S, C kv_lora, R rope, I indexer dim, H heads, K top-k.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm52_jax.config import ModelConfig
from glm52_jax.model import cache_fp8
from glm52_jax.model import context_parallel as context
from glm52_jax.model.indexer import cached_topk, merge_topk, streaming_topk
from glm52_jax.model.kv_cache import KVCache, LayerCacheView, SegmentCache, empty_stacks
from glm52_jax.model.loop_scopes import SUFFIX_KEY_LOOP
from glm52_jax.model.sparse_attention import cached_rows, sparse_mla_rows
from glm52_jax.parallel.rules import constrain

# The suffix's slot axis stays unsharded (replicated over the context axes; see the module docstring).
SUFFIX_AXES = ("layers", None, "batch", None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SuffixCache:
    """Per-sample cache of the tokens after a shared prompt, grouped like `KVCache`:
    c_kv[s] [repeats, U, G, Rc, C], k_rope[s] [repeats, U, G, Rc, R], index_k[s] [repeats, F, G, Rc, I]
    (in the cache dtype); `length`: tokens written ([] int32, the same for every row). Rc = 0 is an empty suffix
    (one chunk run after the prompt and discarded: the response_only update, the new log-probs). With an FP8
    cache c_scale[s] [repeats, U, G, Rc] and i_scale[s] [repeats, F, G, Rc] hold the per-row scales, else ()."""

    c_kv: tuple[jax.Array, ...]
    k_rope: tuple[jax.Array, ...]
    index_k: tuple[jax.Array, ...]
    length: jax.Array
    c_scale: tuple[jax.Array, ...] = ()
    i_scale: tuple[jax.Array, ...] = ()

    @property
    def capacity(self) -> int:
        return self.c_kv[0].shape[3]

    @property
    def rows(self) -> int:
        return self.c_kv[0].shape[2]

    @property
    def cache_dtype(self) -> str:
        return cache_fp8.E4M3.name if self.c_scale else "auto"

    def stacks(self) -> tuple:
        """Every array the suffix holds (values and scales), not `length`."""
        return self.c_kv, self.k_rope, self.index_k, self.c_scale, self.i_scale

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.stacks()))


def init_suffix(cfg: ModelConfig, segments, rows: int, capacity: int, dtype=jnp.bfloat16,
                cache_dtype: str = "auto") -> SuffixCache:
    """An empty suffix for `rows` samples of up to `capacity` tokens each (`capacity` may be 0), in the model's
    `dtype` or with e4m3 latents and keys (`cache_dtype`)."""
    if rows <= 0 or capacity < 0:
        raise ValueError(f"suffix rows must be positive and capacity >= 0, got rows={rows} capacity={capacity}")
    return SuffixCache(**empty_stacks(cfg, segments, rows, capacity, dtype, SUFFIX_AXES, cache_dtype),
                       length=jnp.zeros((), jnp.int32))


def write_suffix(suffix: SuffixCache, new_c, new_r, new_i, seq: int) -> SuffixCache:
    """Writes a chunk's entries (per segment [repeats, U|F, G, S, *]) at suffix slot `length`; length += S
    (quantized per row in an FP8 suffix). An empty suffix (capacity 0) keeps nothing and is returned as it is."""
    if suffix.capacity == 0:
        return suffix

    def put(stack, chunk):
        start = (0, 0, 0, suffix.length) + (0,) * (stack.ndim - 4)
        updated = jax.lax.dynamic_update_slice(stack, chunk.astype(stack.dtype), start)
        return constrain(updated, SUFFIX_AXES[:stack.ndim])

    quantized = bool(suffix.c_scale)
    new_c, c_scale = cache_fp8.store_rows(new_c, quantized)
    new_i, i_scale = cache_fp8.store_rows(new_i, quantized)
    return SuffixCache(tuple(map(put, suffix.c_kv, new_c)), tuple(map(put, suffix.k_rope, new_r)),
                       tuple(map(put, suffix.index_k, new_i)), suffix.length + seq,
                       tuple(map(put, suffix.c_scale, c_scale)), tuple(map(put, suffix.i_scale, i_scale)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SharedCache:
    """The batch-1 `prompt` cache (read only) and the rows' `suffix`: what `GlmMoeDsa.forward_shared`
    runs a chunk against. Answers the layer scan's questions as `KVCache` does."""

    prompt: KVCache
    suffix: SuffixCache

    @property
    def key_slots(self) -> int:
        return self.prompt.capacity + self.suffix.capacity

    @property
    def next_position(self) -> jax.Array:
        return self.prompt.length + self.suffix.length

    def segment(self, s: int) -> SharedSegment:
        sfx = self.suffix
        scales = (sfx.c_scale[s], sfx.i_scale[s]) if sfx.c_scale else (None, None)
        return SharedSegment(self.prompt.segment(s), sfx.c_kv[s], sfx.k_rope[s], sfx.index_k[s], sfx.length, *scales)

    def write(self, new_c, new_r, new_i, seq: int) -> SharedCache:
        return SharedCache(self.prompt, write_suffix(self.suffix, new_c, new_r, new_i, seq))


@dataclasses.dataclass(frozen=True)
class SharedSegment:
    """One segment of a `SharedCache`: the prompt's stacks and the suffix's ([repeats, U|F, G, Rc, *]; scales
    [repeats, U|F, G, Rc] with an FP8 suffix, else None)."""

    prompt: SegmentCache
    c_kv: jax.Array
    k_rope: jax.Array
    index_k: jax.Array
    length: jax.Array  # suffix tokens written
    c_scale: jax.Array | None = None
    i_scale: jax.Array | None = None

    def layer(self, rep, slot: int, full_slot: int | None) -> SharedLayerView:
        full = full_slot is not None
        return SharedLayerView(self.prompt.layer(rep, slot, full_slot), self.c_kv, self.k_rope,
                               self.index_k if full else None, self.length, self.c_scale,
                               self.i_scale if full else None)


@dataclasses.dataclass(frozen=True)
class SharedLayerView:
    """One layer's part of a `SharedCache`: the prompt's `LayerCacheView` and the suffix stacks, read at
    the prompt view's (repeat, slot) / (repeat, full slot)."""

    prompt: LayerCacheView
    suffix_c: jax.Array
    suffix_r: jax.Array
    suffix_i: jax.Array | None
    suffix_length: jax.Array
    suffix_cs: jax.Array | None = None  # per-row scales of an e4m3 suffix_c / suffix_i
    suffix_is: jax.Array | None = None

    @property
    def key_slots(self) -> int:
        return self.prompt.capacity + self.suffix_c.shape[-2]

    def rows_with_chunk(self, stack: jax.Array, index: tuple, chunk: jax.Array, scales: jax.Array | None = None):
        """This layer's suffix rows `[G, Rc, X]` with the chunk `[G, S, X]` placed after the written ones:
        `[G, Rs, X]` in the stack's dtype, row j = key slot L + j (slots past the chunk are never visible).
        An e4m3 stack (with its `scales`) is dequantized to the chunk's dtype first: this layer's G x Rc rows,
        small, and the chunk's own rows enter as computed (they are quantized when written, after the scan)."""
        lead = tuple(jnp.asarray(i, jnp.int32) for i in index)
        layer = stack[lead]
        if scales is not None:
            layer = cache_fp8.read_rows(layer, scales[lead], chunk.dtype)
        layer = jnp.pad(layer, ((0, 0), (0, chunk.shape[1]), (0, 0)))
        return jax.lax.dynamic_update_slice(layer, chunk.astype(layer.dtype), (0, self.suffix_length, 0))


def attention(q_lat, q_rope, c_new, r_new, positions, view: SharedLayerView, index, prev_topk, *, index_topk: int,
              index_scale: float, softmax_scale: float, indexer_blocks: dict, attention_query_block: int,
              kernels: str):
    """A chunk's sparse MLA for G rows against the shared prompt and each row's suffix.

    q_lat: [G,S,H,C], q_rope: [G,S,H,R], c_new: [G,S,C], r_new: [G,S,R], positions: [S] (every row's);
    index: (iq [G,S,Hi,I], iw [G,S,Hi], ik_new [G,S,I]) on a layer with its own indexer, else None and
    `prev_topk: [G,S,K]`. Returns (out_lat [G,S,H,C], top-k [G,S,K] key slots).
    """
    prompt = view.prompt
    rows, seq = q_lat.shape[:2]
    kk = min(index_topk, view.key_slots)
    suffix_c = view.rows_with_chunk(view.suffix_c, prompt.slot, c_new, view.suffix_cs)
    suffix_r = view.rows_with_chunk(view.suffix_r, prompt.slot, r_new)
    query_index = suffix_candidates = None
    if index is not None:
        iq, iw, ik_new = index
        query_index = (iq, iw)
        keys = view.rows_with_chunk(view.suffix_i, prompt.index_slot, ik_new, view.suffix_is)  # [G,Rs,I] float32
        key_pos = prompt.length + jnp.arange(keys.shape[1], dtype=jnp.int32)
        vals, idx = streaming_topk(iq, iw, keys, positions, key_pos, index_topk, scale=index_scale,
                                   return_scores=True, loop_name=SUFFIX_KEY_LOOP, **indexer_blocks)
        suffix_candidates = (vals, jnp.where(idx >= 0, idx + prompt.length, idx))
    scoring = dict(topk=index_topk, kk=kk, scale=index_scale, blocks=indexer_blocks)
    sharded = context.cached_layout(prompt.stride)
    if sharded is not None:
        return _context_parallel(sharded, q_lat, q_rope, suffix_c, suffix_r, positions, prompt, query_index,
                                 suffix_candidates, prev_topk, scoring, softmax_scale, kernels)
    topk = prev_topk
    if index is not None:
        past = prompt_candidates(iq, iw, prompt.index_k, prompt.index_slot, positions, prompt.length, scoring,
                                 prompt.i_scale)
        topk = merge_topk(past, suffix_candidates, kk)
    source = cached_rows(prompt.c_kv, prompt.k_rope, prompt.slot, prompt.length, suffix_c, suffix_r, prompt.c_scale)
    out = sparse_mla_rows(q_lat, q_rope, source, topk, scale=softmax_scale, query_block=attention_query_block,
                          kernels=kernels)
    return out, topk


def prompt_candidates(iq, iw, keys, index_slot, positions, length, scoring: dict, key_scales=None):
    """Top-k candidates of the G*S queries (`iq: [G,S,Hi,I]`, `iw: [G,S,Hi]`) over prompt slots [0, length)
    of the batch-1 key stack `keys: [..., 1, Cap, I]` (e4m3 with `key_scales: [..., 1, Cap]`, or None), scored
    as the queries of one batch row (all rows sit at the same `positions: [S]`). Returns (scores, slots)
    [G,S,k], INVALID / -inf where empty."""
    rows, seq = iq.shape[:2]
    q = iq.reshape(1, rows * seq, *iq.shape[2:])
    w = iw.reshape(1, rows * seq, iw.shape[-1])
    vals, idx = cached_topk(q, w, keys, index_slot, jnp.tile(positions, rows), length, scoring["topk"],
                            scale=scoring["scale"], key_scales=key_scales, **scoring["blocks"])
    return vals.reshape(rows, seq, -1), idx.reshape(rows, seq, -1)


def _context_parallel(sharded, q_lat, q_rope, suffix_c, suffix_r, positions, prompt: LayerCacheView, query_index,
                      suffix_candidates, prev_topk, scoring: dict, softmax_scale: float, kernels: str):
    """`attention` with the prompt's slots laid out over `sharded = (axes, layout)` (`context.cached_layout`): each
    device scores and attends to its own prompt slots; candidates all-gathered, partial softmaxes combined by LSE.
    The attention is `context.cp_cached_attention`'s: the same `context.StridedRows` (here the batch-1 prompt stack
    shared by the G rows as table A, each row's suffix + chunk as table B) and `context.lse_attention`, on the
    sparse MLA kernel when `kernels` picks it (an FP8 prompt cache too: e4m3 rows read with their scales)."""
    axes, layout = sharded
    dtype = q_lat.dtype  # the kernel's query dtype (the shard_map takes float32 copies)
    replicated = P()
    slots = P(None, None, None, axes, None)
    scale_slots = P(None, None, None, axes)

    def per_device(q_lat, q_rope, suffix_c, suffix_r, positions, cache_c, cache_r, cache_i, slot, index_slot, length,
                   query_index, suffix_candidates, prev_topk, cache_cs, cache_is):
        me = jax.lax.axis_index(axes)
        if query_index is not None:
            vals, idx = prompt_candidates(*query_index, cache_i, index_slot, positions, layout.filled(length, me),
                                          scoring, cache_is)
            cand = context.gather_candidates(vals, layout.slot(me, idx), idx >= 0, axes)
            topk = merge_topk(cand, suffix_candidates, scoring["kk"], ties="slot")
        else:
            topk = prev_topk
        # A suffix slot (>= length) is owned by the device its slot would sit on in the prompt's layout.
        keep = (topk >= 0) & (layout.device(topk) == me)
        # A selected slot's row: this device's prompt row (the batch-1 stack, shared by every row), else the row's
        # suffix or chunk (e4m3 prompt rows dequantized with their gathered scales).
        rows = context.StridedRows(layout, cache_c, cache_r, slot, length, suffix_c, suffix_r, cache_cs)
        return context.lse_attention(q_lat, q_rope, rows, topk, keep, softmax_scale, axes, kernels=kernels,
                                     dtype=dtype), topk

    has_index = query_index is not None
    quantized = prompt.c_scale is not None
    fn = jax.shard_map(
        per_device,
        in_specs=(replicated,) * 5 + (slots, slots, slots if has_index else None, replicated,
                                      replicated if has_index else None, replicated,
                                      (replicated,) * 2 if has_index else None,
                                      (replicated,) * 2 if has_index else None,
                                      None if prev_topk is None else replicated,
                                      scale_slots if quantized else None,
                                      scale_slots if quantized and has_index else None),
        out_specs=(replicated, replicated), axis_names=frozenset(axes), check_vma=False)
    # Replicated inputs get their cotangents summed over `axes` in the backward; float32 for the reasons
    # `cp_cached_attention` gives (the suffix rows are cache-dtype values, exact in float32).
    f32 = [a.astype(jnp.float32) for a in (q_lat, q_rope, suffix_c, suffix_r)]
    out, topk = fn(*f32, positions, prompt.c_kv, prompt.k_rope, prompt.index_k if has_index else None, prompt.slot,
                   prompt.index_slot if has_index else None, prompt.length, query_index, suffix_candidates, prev_topk,
                   prompt.c_scale, prompt.i_scale if has_index else None)
    return out.astype(q_lat.dtype), topk
