"""Random DSA indexer inputs shared by the indexer tests (reference and kernel)."""

import jax
import jax.numpy as jnp


def indexer_inputs(seed, b=2, s=37, t=37, h=4, i=16):
    """`q: [b,s,h,i], w: [b,s,h], k: [b,t,i]`, float32 standard normal."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, s, h, i), jnp.float32)
    w = jax.random.normal(ks[1], (b, s, h), jnp.float32)
    k = jax.random.normal(ks[2], (b, t, i), jnp.float32)
    return q, w, k
