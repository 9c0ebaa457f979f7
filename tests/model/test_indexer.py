"""Streaming top-k (the default path) against the dense-score oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dense_oracle import dense_topk
from jaxpr_utils import largest_intermediate

from glm52_jax.model.indexer import INVALID, cached_topk, streaming_topk


def _inputs(seed, b=2, s=37, t=37, h=4, i=16):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, s, h, i), jnp.float32)
    w = jax.random.normal(ks[1], (b, s, h), jnp.float32)
    k = jax.random.normal(ks[2], (b, t, i), jnp.float32)
    return q, w, k


@pytest.mark.parametrize("qb,kb", [(8, 4), (16, 16), (37, 37), (5, 64), (64, 3)])
@pytest.mark.parametrize("topk", [1, 7, 16, 37, 50])
def test_streaming_topk_matches_dense(qb, kb, topk):
    q, w, k = _inputs(0)
    pos = jnp.arange(37, dtype=jnp.int32)
    ours = streaming_topk(q, w, k, pos, pos, topk, scale=0.25, query_block=qb, key_block=kb)
    ref, scores = dense_topk(q, w, k, pos, pos, topk, 0.25)
    assert ours.shape == ref.shape == (2, 37, min(topk, 37))
    # Same order too: both sort by descending score (random inputs have no ties).
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    # Rows with fewer than K causal keys are padded with INVALID, never a future key.
    ours = np.asarray(ours)
    for qi in range(37):
        row = ours[:, qi]
        assert ((row == INVALID) | ((row >= 0) & (row <= qi))).all()
        assert (row != INVALID).sum(-1).tolist() == [min(qi + 1, row.shape[-1])] * 2


def test_offset_queries_against_cached_keys():
    """Queries at positions 30..39 against 40 keys (a decode/chunked-prefill shape)."""
    q, w, _ = _inputs(1, s=10)
    _, _, k = _inputs(2, t=40)
    q_pos = jnp.arange(30, 40, dtype=jnp.int32)
    k_pos = jnp.arange(40, dtype=jnp.int32)
    ours = streaming_topk(q, w, k, q_pos, k_pos, 8, scale=0.25, query_block=4, key_block=16)
    ref, _ = dense_topk(q, w, k, q_pos, k_pos, 8, 0.25)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("capacity,length,kb", [(37, 37, 8), (37, 30, 8), (41, 35, 16), (32, 29, 8), (40, 33, 64)])
def test_cached_topk_blocks_need_not_divide_the_capacity(capacity, length, kb):
    """A stacked cache of any capacity is scanned in kb-slot blocks (the last one moved back inside
    the cache, its already-scored slots masked); same top-k as the dense oracle over `length`
    slots, scores included. (Capacities like 37 used to fall back to 1-slot blocks.)"""
    q, w, _ = _inputs(3, s=4)
    _, _, k = _inputs(4, t=capacity)
    stack = k[None, None]  # [reps=1, F=1, B, Cap, I], read in place at (0, 0)
    q_pos = length + jnp.arange(4, dtype=jnp.int32)
    vals, idx = cached_topk(q, w, stack, (0, 0), q_pos, jnp.asarray(length, jnp.int32), 8, scale=0.25,
                            query_block=4, key_block=kb)
    ref, scores = dense_topk(q, w, k[:, :length], q_pos, jnp.arange(length, dtype=jnp.int32), 8, 0.25)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref))
    want = np.take_along_axis(np.asarray(scores), np.asarray(ref), axis=-1)
    np.testing.assert_allclose(np.asarray(vals), want, rtol=1e-6)


def test_ties_keep_lowest_key_index():
    """Equal scores everywhere: every block merge must keep the earliest keys."""
    b, s, h, i = 1, 12, 2, 4
    q = jnp.ones((b, s, h, i))
    w = jnp.ones((b, s, h))
    k = jnp.ones((b, s, i))
    pos = jnp.arange(s, dtype=jnp.int32)
    ours = np.asarray(streaming_topk(q, w, k, pos, pos, 3, scale=1.0, query_block=5, key_block=2))
    for qi in range(s):
        expect = [x for x in range(min(qi + 1, 3))] + [INVALID] * (3 - min(qi + 1, 3))
        assert ours[0, qi].tolist() == expect


def test_no_score_matrix_in_default_path():
    """The jaxpr of a 4K-query streaming top-k holds no array with S*T elements."""
    s = 4096
    q = jax.ShapeDtypeStruct((1, s, 2, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((1, s, 2), jnp.float32)
    k = jax.ShapeDtypeStruct((1, s, 8), jnp.float32)
    pos = jax.ShapeDtypeStruct((s,), jnp.int32)
    def fn(q, w, k, p):
        return streaming_topk(q, w, k, p, p, 64, scale=1.0, query_block=128, key_block=256)
    biggest = largest_intermediate(jax.make_jaxpr(fn)(q, w, k, pos))
    assert biggest < s * s // 16, biggest
