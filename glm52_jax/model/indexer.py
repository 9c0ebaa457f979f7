"""DSA lightning indexer and its streaming exact top-k.

Score of key s for query t (HF `GlmMoeDsaIndexer`):
    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * index_head_dim**-0.5),  w = weights_proj(x) * H**-0.5
over causal keys (pos[s] <= pos[t]); each query keeps the top `index_topk` keys.

Scalable path: queries are processed in blocks (`lax.map`), and for each block the keys stream
through in blocks (a `fori_loop` that stops at the last causally visible block) while a running
top-k is merged with each new block's scores. No
`[S, T]` array exists; live memory is `O(query_block * (topk + key_block))`.

Axis letters: B batch, S queries, T keys, H indexer heads, I indexer head dim, K top-k, D model dim,
Q q_lora rank, R rotary dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax import positions as rope_lib
from glm52_jax.config import ModelConfig
from glm52_jax.model.layers import LayerNorm, param, project
from glm52_jax.parallel.rules import constrain

INVALID = -1  # top-k slot with no causal key (rows with fewer than K predecessors)


class Indexer(nnx.Module):
    """Projections of one 'full' layer's indexer; `weights_proj` is kept in float32."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = param(rngs, (cfg.q_lora_rank, self.n_heads, self.head_dim), ("q_lora", "index_heads", "index_dim"),
                          dtype)
        self.wk = param(rngs, (cfg.hidden_size, self.head_dim), ("embed", "index_dim"), dtype)
        self.k_norm = LayerNorm(self.head_dim, 1e-6, "index_dim", dtype)
        self.weights_proj = param(rngs, (cfg.hidden_size, self.n_heads), ("embed", "index_heads"), jnp.float32)

    def project(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array):
        """`x: [B,S,D], q_resid: [B,S,Q] -> q: [B,S,H,I], k: [B,S,I], w: [B,S,H]` (float32).

        `w` already includes `H**-0.5`; `q . k` still needs `head_dim**-0.5` (see `topk`).
        """
        q = project(q_resid, self.wq_b, "bsq,qhi->bshi")
        q_rot = rope_lib.apply_interleaved_rope(q[..., : self.rope_dim], cos[:, :, None, :], sin[:, :, None, :])
        q = jnp.concatenate([q_rot, q[..., self.rope_dim:]], axis=-1)
        k = self.k_norm(project(x, self.wk, "bsd,di->bsi"))
        k_rot = rope_lib.apply_interleaved_rope(k[..., : self.rope_dim], cos, sin)
        k = jnp.concatenate([k_rot, k[..., self.rope_dim:]], axis=-1)
        w = jnp.einsum("bsd,dh->bsh", x.astype(jnp.float32), self.weights_proj[...],
                       preferred_element_type=jnp.float32) * (self.n_heads ** -0.5)
        q = constrain(q.astype(jnp.float32), ("batch", "seq", "index_heads", "index_dim"))
        return q, k.astype(jnp.float32), w


def _pad_to(x: jax.Array, axis: int, multiple: int, value) -> jax.Array:
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def block_scores(q: jax.Array, w: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """Index scores of a query block against a key block: `[B,s,H,I], [B,s,H], [B,t,I] -> [B,s,t]`."""
    logits = jnp.einsum("bshi,bti->bsht", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.einsum("bsh,bsht->bst", w, jax.nn.relu(logits))


def streaming_topk(q: jax.Array, w: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, topk: int, *,
                   scale: float, query_block: int, key_block: int, sorted_keys: bool = True,
                   return_scores: bool = False):
    """Exact causal top-k of the index scores without materialising `[S, T]`.

    q: [B,S,H,I], w: [B,S,H], k: [B,T,I], q_pos: [S], k_pos: [T] (key s is visible to query t
    iff k_pos[s] <= q_pos[t]). Returns [B,S,K] int32 key indices, K = min(topk, T), ordered by
    descending score; slots without a visible key hold INVALID. `sorted_keys` (k_pos ascending,
    as in a sequence or a cache) lets each query block stop at its last visible key block.
    With `return_scores`, returns (scores [B,S,K] float32, -inf where INVALID, indices).
    """
    batch = q.shape[0]
    num_keys = k.shape[1]
    kb = min(key_block, num_keys)
    k = jax.lax.stop_gradient(_pad_to(k, 1, kb, 0.0))
    k_pos_p = _pad_to(k_pos, 0, kb, jnp.iinfo(jnp.int32).max)  # padded keys are never visible
    nk = k.shape[1] // kb
    k_blocks = k.reshape(batch, nk, kb, -1).swapaxes(0, 1)  # [nk, B, kb, I]
    kpos_blocks = k_pos_p.reshape(nk, kb)
    # Key blocks whose smallest position exceeds a query block's largest one hold nothing visible;
    # with positions sorted (slot order) the visible blocks are a prefix, so the loop stops there.
    kpos_first = kpos_blocks[:, 0]

    def visible_blocks(qpos_blk):
        if sorted_keys:
            return jnp.sum(kpos_first <= jnp.max(qpos_blk)).astype(jnp.int32)
        return nk

    def read(j):
        return k_blocks[j], kpos_blocks[j], j * kb + jnp.arange(kb, dtype=jnp.int32)

    return _topk_core(q, w, q_pos, read, visible_blocks, kb,
                      min(topk, num_keys), scale, query_block, return_scores)


def cached_topk(q: jax.Array, w: jax.Array, keys: jax.Array, index: tuple, q_pos: jax.Array, length: jax.Array,
                topk: int, *, scale: float, query_block: int, key_block: int):
    """Top-k over cache slots `[0, length)` of `keys[index]` (every query sits at or after `length`).

    keys: [..., B, Cap, I] a stacked cache read in place: each key block is a small dynamic slice
    at `index + (0, block_start, 0)`, so no per-layer copy of the cache is made. Returns
    (scores [B,S,K], indices [B,S,K]) with K = min(topk, Cap), INVALID / -inf where empty.
    """
    batch, capacity, dim = keys.shape[-3:]
    # Few queries (decode) take proportionally longer key blocks: the live score block stays
    # query_block x key_block while the loop runs fewer, larger steps.
    wide = key_block * max(1, query_block // q.shape[1])
    kb = min(wide, capacity)
    lead = tuple(jnp.asarray(i, jnp.int32) for i in index)
    zero = jnp.zeros((), jnp.int32)

    def read(j):
        # Blocks of kb slots from j*kb; when kb does not divide the capacity the last block is
        # moved back to end at the capacity (a slice must stay inside the array) and the slots
        # an earlier block already scored are masked out. (Earlier the block was the gcd of the
        # capacity and kb: 1 slot for a capacity like 8207, and a 100x slower loop.)
        first = j * kb
        start_slot = jnp.minimum(first, capacity - kb)
        blk = jax.lax.dynamic_slice(keys, (*lead, zero, start_slot, zero), (1,) * len(lead) + (batch, kb, dim))
        slots = start_slot + jnp.arange(kb, dtype=jnp.int32)
        kpos = jnp.where((slots >= first) & (slots < length), slots, jnp.iinfo(jnp.int32).max)
        return jax.lax.stop_gradient(blk.reshape(batch, kb, dim).astype(jnp.float32)), kpos, slots

    return _topk_core(q, w, q_pos, read, lambda qpos_blk: (length + kb - 1) // kb, kb, min(topk, capacity), scale,
                      query_block, True)


def merge_topk(first: tuple[jax.Array, jax.Array], second: tuple[jax.Array, jax.Array], topk: int) -> jax.Array:
    """Top-k of two scored candidate lists `(scores, indices) [B,S,*]`; ties keep `first`'s entries."""
    vals = jnp.concatenate([first[0], second[0]], axis=-1)
    idxs = jnp.concatenate([first[1], second[1]], axis=-1)
    best, pos = jax.lax.top_k(vals, min(topk, vals.shape[-1]))
    return jnp.where(jnp.isneginf(best), INVALID, jnp.take_along_axis(idxs, pos, axis=-1))


def _topk_core(q, w, q_pos, read_block, visible_blocks, kb, kk, scale, query_block, return_scores):
    """Query blocks (`lax.map`) x visible key blocks (`fori_loop`) with a running top-k.

    read_block(j) -> (keys [B,kb,I] float32, key positions [kb], key indices [kb]); visible_blocks(qpos_blk) ->
    number of leading key blocks any query of the block can see.
    """
    # No gradient flows through selection (HF runs the indexer under no_grad); stopping it at the
    # inputs also lets the key loop below have a data-dependent trip count.
    q, w = jax.lax.stop_gradient((q, w))
    batch, seq, _, _ = q.shape
    qb = min(query_block, seq)
    q = _pad_to(q, 1, qb, 0.0)
    w = _pad_to(w, 1, qb, 0.0)
    q_pos_p = _pad_to(q_pos, 0, qb, -1)  # padded queries see no key
    nq = q.shape[1] // qb

    def one_query_block(args):
        q_blk, w_blk, qpos_blk = args  # [B,qb,H,I], [B,qb,H], [qb]

        def merge(j, carry):
            best_val, best_idx = carry  # [B,qb,K]
            k_blk, kpos, kidx = read_block(j)
            scores = block_scores(q_blk, w_blk, k_blk, scale)
            visible = kpos[None, None, :] <= qpos_blk[None, :, None]
            scores = jnp.where(visible, scores, -jnp.inf)
            # Running entries come first and hold smaller key indices, so ties keep the lowest index.
            vals = jnp.concatenate([best_val, scores], axis=-1)
            idxs = jnp.concatenate([best_idx, jnp.broadcast_to(kidx, scores.shape)], axis=-1)
            new_val, pos = jax.lax.top_k(vals, kk)
            return new_val, jnp.take_along_axis(idxs, pos, axis=-1)

        init = (jnp.full((batch, qb, kk), -jnp.inf, jnp.float32), jnp.full((batch, qb, kk), INVALID, jnp.int32))
        best_val, best_idx = jax.lax.fori_loop(0, visible_blocks(qpos_blk), merge, init)
        return best_val, jnp.where(jnp.isneginf(best_val), INVALID, best_idx)

    q_blocks = q.reshape(batch, nq, qb, *q.shape[2:]).swapaxes(0, 1)
    w_blocks = w.reshape(batch, nq, qb, -1).swapaxes(0, 1)
    vals, idx = jax.lax.map(one_query_block, (q_blocks, w_blocks, q_pos_p.reshape(nq, qb)))  # [nq,B,qb,K]

    def unblock(x):
        return x.swapaxes(0, 1).reshape(batch, nq * qb, kk)[:, :seq]

    return (unblock(vals), unblock(idx)) if return_scores else unblock(idx)
