"""model/context_parallel.py pieces that need no mesh: the cached partial attention's masked softmax."""

import jax
import jax.numpy as jnp
import numpy as np

from glm52_jax.model.context_parallel import _partial_attention


def test_partial_attention_gradient_is_finite_when_a_masked_key_dominates():
    """One query, two selected keys: key 0 (a cached slot this device holds, logit -200) is kept; key 1
    (a fresh chunk row owned by another device, logit +200) is not. The output is key 0's value and the
    gradient is finite: exp of the masked logit (e^400 = inf) must never meet its zero cotangent."""
    c = 4
    q_lat = jnp.ones((1, 1, 1, c), jnp.float32)
    q_rope = jnp.zeros((1, 1, 1, 2), jnp.float32)
    topk = jnp.asarray([[[0, 1]]], jnp.int32)  # [B,S,K]
    cache_c = jnp.full((1, 1, c), -50.0)  # [B, local_cap=1, C]: logit 4 x -50 = -200
    cache_r = jnp.zeros((1, 1, 2))
    c_new = jnp.full((1, 1, c), 50.0)  # the chunk's row for slot 1 (length 1): logit +200
    r_new = jnp.zeros((1, 1, 2))

    def loss(q_lat, cache_c, c_new):
        out = _partial_attention(q_lat, q_rope, topk, cache_c, cache_r, (), c_new, r_new, jnp.int32(1),
                                 jnp.int32(0), 1, 1.0, ())
        return jnp.sum(out), out

    (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q_lat, cache_c, c_new)
    np.testing.assert_array_equal(np.asarray(out), np.full((1, 1, 1, c), -50.0))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads), grads
    np.testing.assert_array_equal(np.asarray(grads[2]), 0.0)  # the masked key gets no gradient
    np.testing.assert_allclose(np.asarray(grads[1]), 1.0)  # softmax over one key: d out / d value = 1
