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


def sparse_mla(q_lat: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array, topk: jax.Array, *,
               scale: float, query_block: int) -> jax.Array:
    """Attention over each query's selected keys.

    q_lat: [B,S,H,C], q_rope: [B,S,H,R], c_kv: [B,T,C], k_rope: [B,T,R], topk: [B,S,K] int32
    (negative = no key). Returns the latent output [B,S,H,C] in q_lat's dtype.
    """
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
        safe = jnp.where(valid, idx, 0)
        kv = _gather_rows(c_kv, safe)  # [B,qb,K,C]
        kr = _gather_rows(k_rope, safe)  # [B,qb,K,R]
        logits = jnp.einsum("bshc,bskc->bshk", ql, kv, preferred_element_type=jnp.float32)
        logits = logits + jnp.einsum("bshr,bskr->bshk", qr, kr, preferred_element_type=jnp.float32)
        # A finite mask value keeps fully padded query rows NaN-free (their output is discarded, but a
        # NaN there would still poison the gradient of the gathered rows).
        logits = jnp.where(valid[:, :, None, :], logits * scale, _MASKED)
        probs = jax.nn.softmax(logits, axis=-1).astype(kv.dtype)
        return jnp.einsum("bshk,bskc->bshc", probs, kv, preferred_element_type=jnp.float32).astype(ql.dtype)

    out = jax.lax.map(one_block, (blocks(q_lat), blocks(q_rope), blocks(topk)))  # [nq,B,qb,H,C]
    return out.swapaxes(0, 1).reshape(batch, nq * qb, heads, -1)[:, :seq]
