"""Gather-based sparse MLA in absorbed (MQA) form.

Every head attends to the same selected latent rows: key = [c_kv ; k_rope] (C + R wide), value =
c_kv. The per-head key up-projection is absorbed into the query beforehand (q_lat = q_nope W_UK),
so the output is a latent `[.., H, C]` that the caller maps through W_UV.

Queries are processed in blocks; each block gathers its K selected rows, so live memory is
`O(query_block * K * (C + R))` and no `[S, T]` array exists. The block body is rematerialised in
the backward pass, so residuals stay `O(S * K)` indices rather than gathered rows.

Axis letters: B batch, S queries, T keys, H heads, C kv_lora rank, R rotary dim, K top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30


def _gather_rows(rows: jax.Array, idx: jax.Array) -> jax.Array:
    """`rows: [B,T,X], idx: [B,s,K] -> [B,s,K,X]`."""
    return jax.vmap(lambda r, i: r[i])(rows, idx)


def array_rows(c_kv: jax.Array, k_rope: jax.Array):
    """Row source for keys held as plain arrays `c_kv: [B,T,C], k_rope: [B,T,R]`."""
    return lambda idx: (_gather_rows(c_kv, idx), _gather_rows(k_rope, idx))


def cached_rows(cache_c: jax.Array, cache_r: jax.Array, index: tuple, length: jax.Array, new_c: jax.Array,
                new_r: jax.Array):
    """Row source for a chunk attending to a stacked cache plus its own not-yet-written keys.

    cache_c: [..., B, Cap, C] and cache_r: [..., B, Cap, R] are read in place at `index` (one gather
    from the whole stack, no per-layer slice copy); slots `>= length` come from the chunk's own
    rows `new_c: [B,S,C]`, `new_r: [B,S,R]` (slot `length + j` is chunk row j).
    """
    lead = tuple(jnp.asarray(i, jnp.int32) for i in index)

    def rows(idx):  # [B,s,K], all >= 0
        b = jnp.arange(idx.shape[0], dtype=jnp.int32)[:, None, None]
        in_cache = idx < length
        old = jnp.minimum(idx, cache_c.shape[-2] - 1)
        new = jnp.clip(idx - length, 0, new_c.shape[1] - 1)
        out = []
        for cached, fresh in ((cache_c, new_c), (cache_r, new_r)):
            past = cached[(*lead, b, old)]
            mine = _gather_rows(fresh, new).astype(past.dtype)
            out.append(jnp.where(in_cache[..., None], past, mine))
        return tuple(out)

    return rows


def sparse_mla(q_lat: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array, topk: jax.Array, *,
               scale: float, query_block: int) -> jax.Array:
    """Attention over each query's selected keys.

    q_lat: [B,S,H,C], q_rope: [B,S,H,R], c_kv: [B,T,C], k_rope: [B,T,R], topk: [B,S,K] int32
    (negative = no key). Returns the latent output [B,S,H,C] in q_lat's dtype.
    """
    return sparse_mla_rows(q_lat, q_rope, array_rows(c_kv, k_rope), topk, scale=scale, query_block=query_block)


def sparse_mla_rows(q_lat: jax.Array, q_rope: jax.Array, rows, topk: jax.Array, *, scale: float,
                    query_block: int) -> jax.Array:
    """`sparse_mla` with the keys given as a row source: `rows(idx [B,s,K]) -> ([B,s,K,C], [B,s,K,R])`."""
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
