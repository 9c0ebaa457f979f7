"""Gather-based sparse MLA in absorbed (MQA) form.

Every head attends to the same selected latent rows: key = [c_kv ; k_rope] (C + R wide), value =
c_kv. The per-head key up-projection is absorbed into the query beforehand (q_lat = q_nope W_UK),
so the output is a latent `[.., H, C]` that the caller maps through W_UV.

Queries are processed in blocks; each block gathers its K selected rows, so live memory is
`O(query_block * K * (C + R))` and no `[S, T]` array exists. The block body is rematerialised in
the backward pass, so residuals stay `O(S * K)` indices rather than gathered rows.

`kernels` (ModelOptions.kernels) picks the implementation: the jnp reference here, or the Pallas
kernels (`glm52_jax.kernels.sparse_mla`), which read the selected rows in place from the row
source's tables and give the same results (tests/kernels).

Axis letters: B batch, S queries, T keys, H heads, C kv_lora rank, R rotary dim, K top-k.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from glm52_jax import kernels as kernel_seam
from glm52_jax.kernels.sparse_mla import encode_rows, sparse_mla_tables, supported_widths
from glm52_jax.model import cache_fp8

_MASKED = -1e30


def _gather_rows(rows: jax.Array, idx: jax.Array) -> jax.Array:
    """`rows: [B,T,X], idx: [B,s,K] -> [B,s,K,X]`."""
    return jax.vmap(lambda r, i: r[i])(rows, idx)


class ArrayRows:
    """Row source for keys held as plain arrays `c_kv: [B,T,C], k_rope: [B,T,R]`.

    Called with `idx: [B,s,K]` (all >= 0) it gathers `([B,s,K,C], [B,s,K,R])` (the reference path);
    `tables()` / `kv_scales()` / `row_ids(idx)` describe the same rows to the kernels: flat tables `[B*T, *]`
    (no scales) and the absolute row of each slot.
    """

    # The kernels may read these rows in place from `tables()` (as every `CachedRows`, FP8 caches included).
    in_place = True

    def __init__(self, c_kv: jax.Array, k_rope: jax.Array):
        self.c_kv, self.k_rope = c_kv, k_rope

    def __call__(self, idx: jax.Array):
        return _gather_rows(self.c_kv, idx), _gather_rows(self.k_rope, idx)

    def tables(self, dtype=None):
        del dtype  # the rows are the caller's arrays, as they are
        batch, keys = self.c_kv.shape[:2]
        return (self.c_kv.reshape(batch * keys, -1),), (self.k_rope.reshape(batch * keys, -1),)

    def kv_scales(self):
        return None

    def row_ids(self, idx: jax.Array) -> jax.Array:
        batch, keys = self.c_kv.shape[:2]
        return idx + (jnp.arange(batch, dtype=jnp.int32) * keys)[:, None, None]


def array_rows(c_kv: jax.Array, k_rope: jax.Array) -> ArrayRows:
    """Row source for keys held as plain arrays `c_kv: [B,T,C], k_rope: [B,T,R]`."""
    return ArrayRows(c_kv, k_rope)


class CachedRows:
    """Row source for a chunk attending to a stacked cache plus its own not-yet-written keys.

    cache_c: [..., B, Cap, C] and cache_r: [..., B, Cap, R] are read in place at `index` (one gather
    from the whole stack, no per-layer slice copy); slots `>= length` come from the chunk's own
    rows `new_c: [B,S,C]`, `new_r: [B,S,R]` (slot `length + j` is chunk row j). A batch-1 stack is
    shared by all B rows (`model/shared_cache.py`: one prompt cache, `new_*` each row's suffix and
    chunk). For the kernels the tables are the whole stack flattened to rows (A) and the chunk's rows (B).

    An FP8 cache (`c_scale: [..., B, Cap]`, the e4m3 `cache_c` rows' scales): the reference gathers the
    selected e4m3 rows and their scales and dequantizes only those rows (to the chunk's dtype); the kernels
    read the e4m3 rows in place too, with the stack's scales flattened beside table A (`kv_scales()`), and
    dequantize each selected row as they load it (the same rounding). Such a cache is a constant for the
    kernels: its tables (c_kv and k_rope) get no gradient, the chunk's rows (table B) and the queries do.
    """

    # Every cache is read in place by the kernels (an FP8 one with its scales).
    in_place = True

    def __init__(self, cache_c, cache_r, index: tuple, length, new_c, new_r, c_scale=None):
        self.cache_c, self.cache_r, self.new_c, self.new_r = cache_c, cache_r, new_c, new_r
        self.lead = tuple(jnp.asarray(i, jnp.int32) for i in index)
        self.length = length
        self.c_scale = c_scale

    def _slots(self, idx):
        b = jnp.arange(idx.shape[0], dtype=jnp.int32)[:, None, None]
        in_cache = idx < self.length
        old = jnp.minimum(idx, self.cache_c.shape[-2] - 1)
        new = jnp.clip(idx - self.length, 0, self.new_c.shape[1] - 1)
        return b, in_cache, old, new

    def _cache_row(self, b):
        """The stack's batch index of query row `b`: its own, or 0 for a shared batch-1 stack."""
        return b if self.cache_c.shape[-3] > 1 else jnp.zeros_like(b)

    def __call__(self, idx):  # [B,s,K], all >= 0
        b, in_cache, old, new = self._slots(idx)
        out = []
        for cached, scales, fresh in ((self.cache_c, self.c_scale, self.new_c), (self.cache_r, None, self.new_r)):
            at = (*self.lead, self._cache_row(b), old)
            past = cached[at]
            if scales is not None:  # the gathered e4m3 rows dequantized with their gathered scales
                past = cache_fp8.read_rows(past, scales[at], fresh.dtype)
            mine = _gather_rows(fresh, new).astype(past.dtype)
            out.append(jnp.where(in_cache[..., None], past, mine))
        return tuple(out)

    def tables(self, dtype=None):
        """(kv tables, kr tables): the whole stack flattened to rows (A) and the chunk's rows (B) in the cache's
        dtype, or for an FP8 cache in `dtype` (the kernel's compute dtype; default the chunk's) beside the e4m3
        rows and the cache's k_rope."""
        def chunk_dtype(cached):
            if self.c_scale is None:
                return cached.dtype
            return self.new_c.dtype if dtype is None else dtype
        return tuple((cached.reshape(-1, cached.shape[-1]),
                      fresh.astype(chunk_dtype(cached)).reshape(-1, cached.shape[-1]))
                     for cached, fresh in ((self.cache_c, self.new_c), (self.cache_r, self.new_r)))

    def kv_scales(self):
        """None, or for an FP8 cache the scales of table A's rows (`[rows]` float32) and None for table B."""
        return None if self.c_scale is None else (self.c_scale.reshape(-1), None)

    def row_ids(self, idx: jax.Array) -> jax.Array:
        b, in_cache, old, new = self._slots(idx)
        stack = self.cache_c.shape[:-3]
        batch, capacity = self.cache_c.shape[-3:-1]
        flat_lead = sum((i * math.prod(stack[n + 1:]) for n, i in enumerate(self.lead)), jnp.int32(0))
        in_stack = (flat_lead * batch + self._cache_row(b)) * capacity + old
        stack_rows = math.prod(stack) * batch * capacity
        return jnp.where(in_cache, in_stack, stack_rows + b * self.new_c.shape[1] + new)


def cached_rows(cache_c: jax.Array, cache_r: jax.Array, index: tuple, length: jax.Array, new_c: jax.Array,
                new_r: jax.Array, c_scale: jax.Array | None = None) -> CachedRows:
    """Row source for a chunk attending to a stacked cache plus its own keys (see `CachedRows`; `c_scale`:
    the per-row scales of an e4m3 `cache_c`)."""
    return CachedRows(cache_c, cache_r, index, length, new_c, new_r, c_scale)


def sparse_mla(q_lat: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array, topk: jax.Array, *,
               scale: float, query_block: int, kernels: str = "reference") -> jax.Array:
    """Attention over each query's selected keys.

    q_lat: [B,S,H,C], q_rope: [B,S,H,R], c_kv: [B,T,C], k_rope: [B,T,R], topk: [B,S,K] int32
    (negative = no key). Returns the latent output [B,S,H,C] in q_lat's dtype.
    """
    return sparse_mla_rows(q_lat, q_rope, array_rows(c_kv, k_rope), topk, scale=scale, query_block=query_block,
                           kernels=kernels)


def pallas_interpret(kernels: str, q_lat: jax.Array, q_rope: jax.Array) -> bool | None:
    """None: run the reference; else whether the Pallas kernels run in interpret mode (no GPU target)."""
    if not kernel_seam.use_pallas(kernels):
        return None
    problem = supported_widths(q_lat.shape[-1], q_rope.shape[-1])
    if problem is not None:
        if kernels == "auto":
            return None
        raise ValueError(f"kernels='pallas': {problem}")
    return kernel_seam.interpret()


def sparse_mla_rows(q_lat: jax.Array, q_rope: jax.Array, rows, topk: jax.Array, *, scale: float,
                    query_block: int, kernels: str = "reference") -> jax.Array:
    """`sparse_mla` with the keys given as a row source (`ArrayRows` / `CachedRows`, or any callable
    `rows(idx [B,s,K]) -> ([B,s,K,C], [B,s,K,R])` for the reference). With the kernels, an FP8 cache's rows
    (`CachedRows` with `c_scale`) are read in place and dequantized by the kernel; a source that is not
    `in_place` always takes the reference's gathered path."""
    interpret = pallas_interpret(kernels, q_lat, q_rope) if getattr(rows, "in_place", True) else None
    if interpret is not None:
        valid = topk >= 0
        codes = encode_rows(rows.row_ids(jnp.where(valid, topk, 0)), valid)
        kv_tables, kr_tables = rows.tables(q_lat.dtype)
        return sparse_mla_tables(q_lat, q_rope, kv_tables, kr_tables, codes, scale=scale, interpret=interpret,
                                 kv_scales=rows.kv_scales())[0]
    batch, seq, heads, _ = q_lat.shape
    qb = min(query_block, seq)
    pad = (-seq) % qb
    if pad:
        q_lat = jnp.pad(q_lat, ((0, 0), (0, pad), (0, 0), (0, 0)))
        q_rope = jnp.pad(q_rope, ((0, 0), (0, pad), (0, 0), (0, 0)))
        topk = jnp.pad(topk, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    nq = q_lat.shape[1] // qb

    def blocks(x):
        return x.reshape(batch, nq, qb, *x.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def one_block(args):
        ql, qr, idx = args  # [B,qb,H,C], [B,qb,H,R], [B,qb,K]
        valid = idx >= 0
        kv, kr = rows(jnp.where(valid, idx, 0))  # [B,qb,K,C], [B,qb,K,R]
        kv, kr = kv.astype(ql.dtype), kr.astype(qr.dtype)
        logits = jnp.einsum("bshc,bskc->bshk", ql, kv, preferred_element_type=jnp.float32)
        logits = logits + jnp.einsum("bshr,bskr->bshk", qr, kr, preferred_element_type=jnp.float32)
        # A finite mask value keeps fully padded query rows NaN-free (their output is discarded, but a
        # NaN there would still poison the gradient of the gathered rows).
        logits = jnp.where(valid[:, :, None, :], logits * scale, _MASKED)
        probs = jax.nn.softmax(logits, axis=-1).astype(kv.dtype)
        return jnp.einsum("bshk,bskc->bshc", probs, kv, preferred_element_type=jnp.float32).astype(ql.dtype)

    out = jax.lax.map(one_block, (blocks(q_lat), blocks(q_rope), blocks(topk)))  # [nq,B,qb,H,C]
    return out.swapaxes(0, 1).reshape(batch, nq * qb, heads, -1)[:, :seq]
