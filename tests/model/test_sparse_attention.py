"""Gather-based absorbed sparse MLA against the dense-mask oracle (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dense_oracle import dense_sparse_mla

from glm52_jax.model.indexer import streaming_topk
from glm52_jax.model.sparse_attention import sparse_mla


def _inputs(seed, b=2, s=29, h=3, c=16, r=8, k=9):
    ks = jax.random.split(jax.random.key(seed), 6)
    q_lat = jax.random.normal(ks[0], (b, s, h, c))
    q_rope = jax.random.normal(ks[1], (b, s, h, r))
    c_kv = jax.random.normal(ks[2], (b, s, c))
    k_rope = jax.random.normal(ks[3], (b, s, r))
    # A real causal selection from random index scores (rows below k have -1 padding).
    pos = jnp.arange(s, dtype=jnp.int32)
    topk = streaming_topk(jax.random.normal(ks[4], (b, s, 2, 4)), jax.random.normal(ks[5], (b, s, 2)),
                          jax.random.normal(ks[4], (b, s, 4)), pos, pos, k, scale=1.0, query_block=8, key_block=8)
    return q_lat, q_rope, c_kv, k_rope, topk


@pytest.mark.parametrize("query_block", [1, 4, 29, 64])
def test_matches_dense_oracle(query_block):
    q_lat, q_rope, c_kv, k_rope, topk = _inputs(0)
    ours = sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, scale=0.3, query_block=query_block)
    ref = dense_sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, 0.3)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_gradients_match_dense_oracle():
    q_lat, q_rope, c_kv, k_rope, topk = _inputs(1)
    proj = jax.random.normal(jax.random.key(9), q_lat.shape)

    def loss(fn, *args):
        return jnp.sum(fn(*args) * proj)

    ours = jax.grad(lambda *a: loss(lambda *x: sparse_mla(*x, topk, scale=0.3, query_block=8), *a),
                    argnums=(0, 1, 2, 3))(q_lat, q_rope, c_kv, k_rope)
    ref = jax.grad(lambda *a: loss(lambda *x: dense_sparse_mla(*x, topk, 0.3), *a),
                   argnums=(0, 1, 2, 3))(q_lat, q_rope, c_kv, k_rope)
    for g, gr in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-4, atol=1e-5)
