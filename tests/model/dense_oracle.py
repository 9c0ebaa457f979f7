"""Dense-mask DSA: the O(S*T) formulation, used only as a test oracle at small sizes."""

import jax
import jax.numpy as jnp


def dense_index_scores(q, w, k, q_pos, k_pos, scale):
    """`[B,S,H,I], [B,S,H], [B,T,I] -> [B,S,T]` with non-causal entries at -inf."""
    logits = jnp.einsum("bshi,bti->bsht", q, k) * scale
    scores = jnp.einsum("bsh,bsht->bst", w, jax.nn.relu(logits))
    return jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], scores, -jnp.inf)


def dense_topk(q, w, k, q_pos, k_pos, topk, scale):
    scores = dense_index_scores(q, w, k, q_pos, k_pos, scale)
    vals, idx = jax.lax.top_k(scores, min(topk, k.shape[1]))
    return jnp.where(jnp.isneginf(vals), -1, idx), scores


def dense_sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, scale):
    """Full `[B,H,S,T]` attention with a mask built from the top-k indices."""
    t = c_kv.shape[1]
    selected = jnp.zeros(topk.shape[:2] + (t,), bool)
    selected = jax.vmap(jax.vmap(lambda m, i: m.at[jnp.where(i >= 0, i, t)].set(True, mode="drop")))(selected, topk)
    logits = jnp.einsum("bshc,btc->bsht", q_lat, c_kv) + jnp.einsum("bshr,btr->bsht", q_rope, k_rope)
    logits = jnp.where(selected[:, :, None, :], logits * scale, -jnp.inf)
    return jnp.einsum("bsht,btc->bshc", jax.nn.softmax(logits, axis=-1), c_kv)
