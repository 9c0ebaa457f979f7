"""Streaming top-k (the default path) against the dense-score oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dense_oracle import dense_topk
from flax import nnx
from indexer_inputs import indexer_inputs as _inputs
from jaxpr_utils import all_eqns, largest_intermediate

import glm52_jax
from glm52_jax import config, positions
from glm52_jax.model import indexer
from glm52_jax.model.indexer import INVALID, cached_topk, streaming_topk
from glm52_jax.model.layers import project
from glm52_jax.model.mla import Attention
from glm52_jax.model.transformer import GlmMoeDsa


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


def _cache_loops(q_len, capacity, length, query_block, key_block):
    """The loops of `cached_topk`'s traced program that read key blocks from the cache, as
    (primitive, trip count or None, cache-axis width of each block read). `length` an int makes the
    trip count static (the key loop is then a scan of that length); None traces it (a while loop, as
    in the model, where the cache length is data)."""
    i = 8
    cache = jax.ShapeDtypeStruct((1, 1, 1, capacity, i), jnp.float32)  # [reps, F, B, Cap, I]
    q = jax.ShapeDtypeStruct((1, q_len, 2, i), jnp.float32)
    w = jax.ShapeDtypeStruct((1, q_len, 2), jnp.float32)

    def fn(q, w, cache, n):
        q_pos = n + jnp.arange(q_len, dtype=jnp.int32)
        return cached_topk(q, w, cache, (0, 0), q_pos, n, 8, scale=0.25, query_block=query_block,
                           key_block=key_block)

    if length is None:
        jaxpr = jax.make_jaxpr(fn)(q, w, cache, jax.ShapeDtypeStruct((), jnp.int32))
    else:
        jaxpr = jax.make_jaxpr(lambda q, w, cache: fn(q, w, cache, length))(q, w, cache)
    loops = []
    for eqn in all_eqns(jaxpr.jaxpr):
        body = {"scan": "jaxpr", "while": "body_jaxpr"}.get(eqn.primitive.name)
        if body is None:
            continue
        reads = [e.params["slice_sizes"][3] for e in eqn.params[body].jaxpr.eqns
                 if e.primitive.name == "dynamic_slice" and e.invars[0].aval.shape == cache.shape]
        if reads:
            loops.append((eqn.primitive.name, eqn.params.get("length"), reads))
    return loops


@pytest.mark.parametrize("q_len,capacity,length,key_block,want_kb", [
    (4, 8207, 8200, 64, 64),  # the bench's capacity P-1+R: gcd(8207, 64) = 1 made 8,200 one-slot steps
    (1, 8207, 8207, 64, 256),  # decode (1 query): blocks widened by query_block // queries = 4
    (1, 300, 250, 128, 300),  # the widened block exceeds the capacity: one block of the whole cache
])
def test_cached_topk_key_blocks_keep_their_width(q_len, capacity, length, key_block, want_kb):
    """The key loop's structure itself: each step reads one block of the full width, and the loop
    runs ceil(length / width) steps, whatever the capacity's divisors."""
    # Traced length (the model's case): a while loop whose body reads one want_kb-slot block.
    assert _cache_loops(q_len, capacity, None, 4, key_block) == [("while", None, [want_kb])]
    # Static length: the same loop as a scan, so its trip count is visible in the program.
    assert _cache_loops(q_len, capacity, length, 4, key_block) == [("scan", -(-length // want_kb), [want_kb])]


def test_cached_topk_at_an_odd_capacity_matches_dense():
    """The first case above, computed: 8,207 slots (odd: no 64-slot tiling), the last block moved back."""
    capacity, length = 8207, 8200
    q, w, _ = _inputs(5, s=4)
    _, _, k = _inputs(6, t=capacity)
    q_pos = length + jnp.arange(4, dtype=jnp.int32)
    vals, idx = jax.jit(lambda q, w, c, n: cached_topk(q, w, c, (0, 0), q_pos, n, 8, scale=0.25, query_block=4,
                                                       key_block=64))(q, w, k[None, None], jnp.int32(length))
    ref, scores = dense_topk(q, w, k[:, :length], q_pos, jnp.arange(length, dtype=jnp.int32), 8, 0.25)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref))
    np.testing.assert_allclose(np.asarray(vals), np.take_along_axis(np.asarray(scores), np.asarray(ref), -1),
                               rtol=1e-6)


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


# -- FP8 scoring's Hadamard rotation ----------------------------------------------------------------------------

def test_hadamard_is_the_orthonormal_sylvester_matrix():
    """Sylvester's order ([[H, H], [H, -H]] / sqrt 2, DeepSeek's `hadamard_transform`), orthonormal and symmetric;
    an order that is not a power of 2 is refused."""
    np.testing.assert_array_equal(indexer.hadamard(2) * np.sqrt(2), [[1, 1], [1, -1]])
    h = indexer.hadamard(128)
    np.testing.assert_array_equal(h[:64, 64:], h[:64, :64])
    np.testing.assert_array_equal(h[64:, 64:], -h[:64, :64])
    np.testing.assert_allclose(h @ h, np.eye(128), atol=1e-12)
    np.testing.assert_allclose(np.abs(h), np.full((128, 128), 128 ** -0.5), rtol=1e-15)
    with pytest.raises(ValueError, match="power of 2"):
        indexer.hadamard(96)


def test_rotation_keeps_the_scores():
    """(q H) . (k H) = q . k: in float32 the rotated scores equal the plain ones to rounding."""
    q, w, k = _inputs(1, 1, 24, 40, 4, 32)
    plain = np.asarray(indexer.block_scores(q, w, k, 32 ** -0.5))
    rotated = indexer.block_scores(indexer.rotate_rows(q), w, indexer.rotate_rows(k), 32 ** -0.5)
    np.testing.assert_allclose(rotated, plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))


@pytest.mark.parametrize("indexer_dtype,candidates", [("bf16", 0), ("fp8", 0), ("fp8", 40)])
def test_fp8_layers_score_and_cache_rotated_keys(indexer_dtype, candidates):
    """A bf16 attention layer with `indexer_dtype="fp8"` emits (for its cache) the keys rotated and rounded to bf16,
    and selects the FP8 top-k of the rotated q and k; with bf16 scoring or rescored FP8 candidates, the plain keys
    and their top-k (bf16's own: here the 40 candidates are every key a query sees past the top-32)."""
    cfg = config.tiny()
    opts = glm52_jax.ModelOptions(param_dtype=jnp.bfloat16, indexer_query_block=16, indexer_key_block=16,
                                  kernels="reference", indexer_dtype=indexer_dtype, indexer_candidates=candidates)
    layer = Attention(cfg, True, opts, nnx.Rngs(0))
    seq = 48
    x = jax.random.normal(jax.random.key(1), (1, seq, cfg.hidden_size), jnp.bfloat16)
    pos = jnp.arange(seq, dtype=jnp.int32)
    cos, sin = (t[None] for t in positions.rope_cos_sin(pos, positions.rotary_table(cfg.rope, cfg.qk_rope_head_dim)))
    _, topk, (_, _, ik) = layer(x, cos, sin, pos, None)

    fp8 = indexer_dtype == "fp8" and not candidates
    q_resid = layer.q_a_layernorm(project(x, layer.q_a_proj, "bsd,dq->bsq"))
    q, k, w = layer.indexer.project(x, q_resid, cos, sin, rotate=fp8)
    plain_k = layer.indexer.project(x, q_resid, cos, sin)[1]
    np.testing.assert_array_equal(np.asarray(ik, np.float32), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(k), np.asarray(k.astype(jnp.bfloat16).astype(jnp.float32)))
    if fp8:
        np.testing.assert_array_equal(k, indexer.rotate_rows(plain_k.astype(jnp.bfloat16)).astype(jnp.float32))
        assert not np.allclose(k, plain_k, atol=1e-2)
    want = streaming_topk(q, w, k, pos, pos, cfg.index_topk, scale=cfg.index_head_dim ** -0.5, query_block=16,
                          key_block=16, indexer_dtype=indexer_dtype, candidates=candidates)
    np.testing.assert_array_equal(np.asarray(topk), np.asarray(want))
    if candidates:  # 48 keys, at most 40 past the top-32 kept: bf16's selection
        bf16 = streaming_topk(q, w, k, pos, pos, cfg.index_topk, scale=cfg.index_head_dim ** -0.5, query_block=16,
                              key_block=16)
        np.testing.assert_array_equal(np.asarray(topk), np.asarray(bf16))


def test_fp8_scoring_needs_a_power_of_2_head_dim():
    cfg = config.tiny(index_head_dim=48)
    with pytest.raises(ValueError, match="index_head_dim a power of 2"):
        nnx.eval_shape(lambda: GlmMoeDsa(cfg, glm52_jax.ModelOptions(indexer_dtype="fp8"), rngs=nnx.Rngs(0)))
