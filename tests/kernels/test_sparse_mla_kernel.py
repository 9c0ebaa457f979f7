"""Sparse MLA Pallas kernels (interpret mode on CPU) against the jnp reference: output, log-sum-exp, gradients.

float32: 1e-5 relative (max |diff| / max |reference|). bf16: the kernel's error against the float32 truth
stays within 1.5x the reference's own bf16 error (plus 1e-3 relative), and below 2e-2 relative L2.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm52_jax.kernels.sparse_mla import DEFAULT_CONFIG, encode_rows, sparse_mla_tables
from glm52_jax.model import cache_fp8
from glm52_jax.model.indexer import streaming_topk
from glm52_jax.model.sparse_attention import array_rows, cached_rows, sparse_mla, sparse_mla_rows

SCALE = 0.3
H, C, R = 4, 32, 16  # 4 heads are padded to the 16-row MMA tile inside the kernels
RTOL = 1e-5


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _rel_l2(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def _normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _prefill(seed=0, b=2, s=13, k=8, dtype=jnp.float32):
    """A causal selection of a real streaming top-k (early queries hold -1 slots), query (0, 5) fully masked."""
    ks = jax.random.split(jax.random.key(seed), 7)
    q_lat, q_rope = _normal(ks[0], (b, s, H, C), dtype), _normal(ks[1], (b, s, H, R), dtype)
    c_kv, k_rope = _normal(ks[2], (b, s, C), dtype), _normal(ks[3], (b, s, R), dtype)
    pos = jnp.arange(s, dtype=jnp.int32)
    topk = streaming_topk(_normal(ks[4], (b, s, 2, 8)), _normal(ks[5], (b, s, 2)), _normal(ks[6], (b, s, 8)), pos,
                          pos, k, scale=1.0, query_block=4, key_block=4)
    return q_lat, q_rope, c_kv, k_rope, topk.at[0, 5].set(-1)


def _kernel_on_arrays(q_lat, q_rope, c_kv, k_rope, topk, config=DEFAULT_CONFIG):
    rows = array_rows(c_kv, k_rope)
    valid = topk >= 0
    kv, kr = rows.tables()
    return sparse_mla_tables(q_lat, q_rope, kv, kr, encode_rows(rows.row_ids(jnp.where(valid, topk, 0)), valid),
                             scale=SCALE, interpret=True, config=config)


def _reference_lse(q_lat, q_rope, c_kv, k_rope, topk):
    """Log-sum-exp of the reference's masked logits (masked slots at -1e30, as in sparse_mla_rows)."""
    valid = topk >= 0
    kv, kr = array_rows(c_kv, k_rope)(jnp.where(valid, topk, 0))
    logits = jnp.einsum("bshc,bskc->bshk", q_lat, kv) + jnp.einsum("bshr,bskr->bshk", q_rope, kr)
    return jax.nn.logsumexp(jnp.where(valid[:, :, None, :], logits * SCALE, -1e30), axis=-1)


def _value_and_grads(attend, lse_fn, args, n_diff):
    """(out, lse, grads of sum(out * P1) + sum(lse * P2) w.r.t. the first n_diff args)."""
    p1 = jax.random.normal(jax.random.key(11), args[0].shape, jnp.float32)
    p2 = jax.random.normal(jax.random.key(12), args[0].shape[:3], jnp.float32)

    def loss(*diff):
        out, lse = attend(*diff, *args[n_diff:]), lse_fn(*diff, *args[n_diff:])
        return jnp.sum(out.astype(jnp.float32) * p1) + jnp.sum(lse * p2), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n_diff)), has_aux=True))(
        *args[:n_diff])
    return out, lse, grads


@pytest.fixture(scope="module")
def prefill_f32():
    args = _prefill()
    ours = _value_and_grads(lambda *a: _kernel_on_arrays(*a)[0], lambda *a: _kernel_on_arrays(*a)[1], args, 4)
    ref = _value_and_grads(lambda *a: sparse_mla(*a, scale=SCALE, query_block=4), _reference_lse, args, 4)
    return args, ours, ref


def test_prefill_output_and_lse(prefill_f32):
    args, (out, lse, _), (ref_out, ref_lse, _) = prefill_f32
    assert _rel(out, ref_out) <= RTOL
    # The fully masked query averages the row index 0 maps to, as the reference does.
    np.testing.assert_allclose(np.asarray(out[0, 5]), np.broadcast_to(np.asarray(args[2][0, 0]), (H, C)), rtol=1e-6)
    real = np.asarray(args[4][..., 0] >= 0)  # lse of a fully masked query is -1e30 + log K on both sides
    assert _rel(np.asarray(lse)[real], np.asarray(ref_lse)[real]) <= RTOL


def test_prefill_gradients(prefill_f32):
    _, (_, _, grads), (_, _, ref_grads) = prefill_f32
    for name, g, r in zip(("q_lat", "q_rope", "c_kv", "k_rope"), grads, ref_grads, strict=True):
        assert _rel(g, r) <= RTOL, (name, _rel(g, r))


def test_decode_slot_splits_and_padding():
    """Few queries split their slots over programs (combined by log-sum-exp); K=40 is padded to the block."""
    ks = jax.random.split(jax.random.key(3), 5)
    b, t, k = 3, 50, 40
    q_lat, q_rope = _normal(ks[0], (b, 1, H, C)), _normal(ks[1], (b, 1, H, R))
    c_kv, k_rope = _normal(ks[2], (b, t, C)), _normal(ks[3], (b, t, R))
    topk = jax.vmap(lambda key: jax.random.permutation(key, t)[:k])(jax.random.split(ks[4], b))[:, None, :]
    topk = topk.at[1, 0, 30:].set(-1).astype(jnp.int32)
    config = dataclasses.replace(DEFAULT_CONFIG, block_k=16)  # 3 blocks -> 2 splits per query
    out, lse = jax.jit(lambda *a: _kernel_on_arrays(*a, config=config))(q_lat, q_rope, c_kv, k_rope, topk)
    assert _rel(out, sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, scale=SCALE, query_block=1)) <= RTOL
    assert _rel(lse, _reference_lse(q_lat, q_rope, c_kv, k_rope, topk)) <= RTOL


def test_cached_rows_two_tables():
    """A chunk over a stacked cache read in place (table A) plus its own rows (table B); gradients reach both."""
    ks = jax.random.split(jax.random.key(4), 8)
    b, s, cap, length, k = 2, 6, 24, 10, 12
    cache_c, cache_r = _normal(ks[0], (2, b, cap, C)), _normal(ks[1], (2, b, cap, R))
    new_c, new_r = _normal(ks[2], (b, s, C)), _normal(ks[3], (b, s, R))
    q_lat, q_rope = _normal(ks[4], (b, s, H, C)), _normal(ks[5], (b, s, H, R))
    visible = length + jnp.arange(s)[None, :, None]  # chunk row j sees slots <= length + j
    scores = jnp.where(jnp.arange(cap)[None, None, :] <= visible, jax.random.uniform(ks[6], (b, s, cap)), -1.0)
    vals, topk = jax.lax.top_k(scores, k)
    topk = jnp.where(vals < 0, -1, topk).astype(jnp.int32)  # rows 0-1 hold fewer than k visible slots

    def attend(kernels):
        def fn(q_lat, q_rope, cache_c, cache_r, new_c, new_r, topk):
            rows = cached_rows(cache_c, cache_r, (1,), jnp.int32(length), new_c, new_r)
            return sparse_mla_rows(q_lat, q_rope, rows, topk, scale=SCALE, query_block=4, kernels=kernels)
        return fn

    args = (q_lat, q_rope, cache_c, cache_r, new_c, new_r, topk)
    no_lse = lambda *a: jnp.zeros(a[0].shape[:3])  # noqa: E731
    out, _, grads = _value_and_grads(attend("pallas"), no_lse, args, 6)
    ref_out, _, ref_grads = _value_and_grads(attend("reference"), no_lse, args, 6)
    assert _rel(out, ref_out) <= RTOL
    for name, g, r in zip(("q_lat", "q_rope", "cache_c", "cache_r", "new_c", "new_r"), grads, ref_grads, strict=True):
        assert _rel(g, r) <= RTOL, (name, _rel(g, r))
    assert np.all(np.asarray(grads[2])[0] == 0)  # the other layer of the stack gets nothing


def test_chunked_backward(prefill_f32):
    """The backward's query chunks (a bounded per-slot buffer) accumulate to the same gradients."""
    args, _, (_, _, ref_grads) = prefill_f32
    config = dataclasses.replace(DEFAULT_CONFIG, chunk_entries=48)  # 26 queries x 8 slots -> 5 chunks

    def loss(q_lat, q_rope, c_kv, k_rope):
        out, lse = _kernel_on_arrays(q_lat, q_rope, c_kv, k_rope, args[4], config=config)
        p1 = jax.random.normal(jax.random.key(11), out.shape, jnp.float32)
        p2 = jax.random.normal(jax.random.key(12), lse.shape, jnp.float32)
        return jnp.sum(out * p1) + jnp.sum(lse * p2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args[:4])
    for name, g, r in zip(("q_lat", "q_rope", "c_kv", "k_rope"), grads, ref_grads, strict=True):
        assert _rel(g, r) <= RTOL, (name, _rel(g, r))


def test_bf16_within_reference_error():
    """bf16 inputs: kernel and reference (both bf16) against the float32 result on the same rounded inputs."""
    args16 = _prefill(dtype=jnp.bfloat16)
    args32 = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args16)
    truth = _value_and_grads(lambda *a: sparse_mla(*a, scale=SCALE, query_block=4), _reference_lse, args32, 4)
    ours = _value_and_grads(lambda *a: _kernel_on_arrays(*a)[0], lambda *a: _kernel_on_arrays(*a)[1], args16, 4)
    ref = _value_and_grads(lambda *a: sparse_mla(*a, scale=SCALE, query_block=4), _reference_lse, args16, 4)
    pairs = [("out", ours[0], ref[0], truth[0])] + [
        (name, g, r, t) for name, g, r, t in zip(("q_lat", "q_rope", "c_kv", "k_rope"), ours[2], ref[2], truth[2],
                                                 strict=True)]
    for name, g, r, t in pairs:
        err, ref_err = _rel_l2(g, t), _rel_l2(r, t)
        assert err <= 1.5 * ref_err + 1e-3 and err <= 2e-2, (name, err, ref_err)


def test_dispatch(prefill_f32):
    """kernels='auto' is the reference on a CPU backend; 'pallas' refuses widths the kernels cannot tile."""
    q_lat, q_rope, c_kv, k_rope, topk = prefill_f32[0]
    auto = sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, scale=SCALE, query_block=4, kernels="auto")
    ref = sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, scale=SCALE, query_block=4)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))
    with pytest.raises(ValueError, match="not a power of two"):
        sparse_mla(q_lat[..., :24], q_rope, c_kv[..., :24], k_rope, topk, scale=SCALE, query_block=4,
                   kernels="pallas")


def test_fp8_cache_table_equals_the_dequantized_rows():
    """An FP8 cache (`cache_fp8`: e4m3 c_kv rows, one float32 scale per row; k_rope unquantized) read in place as
    table A with its scales beside the chunk's rows (table B): the kernel dequantizes each selected row as
    `read_rows` does, so output, log-sum-exp and the gradients of q and the chunk's rows equal the reference over
    the dequantized rows to float32 rounding. The cache's tables are constants: their gradient is zero."""
    ks = jax.random.split(jax.random.key(5), 8)
    b, s, cap, length, k = 2, 5, 24, 10, 12
    # Rows of very different magnitudes: each needs its own scale.
    cache = _normal(ks[0], (2, b, cap, C)) * jnp.exp(2 * _normal(ks[7], (2, b, cap, 1)))
    cache_c, c_scale = cache_fp8.quantize_rows(cache)
    cache_r, new_c, new_r = _normal(ks[1], (2, b, cap, R)), _normal(ks[2], (b, s, C)), _normal(ks[3], (b, s, R))
    q_lat, q_rope = _normal(ks[4], (b, s, H, C)), _normal(ks[5], (b, s, H, R))
    visible = length + jnp.arange(s)[None, :, None]
    scores = jnp.where(jnp.arange(cap)[None, None, :] <= visible, jax.random.uniform(ks[6], (b, s, cap)), -1.0)
    vals, topk = jax.lax.top_k(scores, k)
    topk = jnp.where(vals < 0, -1, topk).astype(jnp.int32).at[1, 0].set(-1)  # query (1, 0): no key at all
    assert c_scale.dtype == jnp.float32 and float(jnp.max(c_scale) / jnp.min(c_scale)) > 100

    def kernel(q_lat, q_rope, new_c, new_r, cache_r):  # (out, lse)
        rows = cached_rows(cache_c, cache_r, (1,), jnp.int32(length), new_c, new_r, c_scale)
        valid = topk >= 0
        codes = encode_rows(rows.row_ids(jnp.where(valid, topk, 0)), valid)
        return sparse_mla_tables(q_lat, q_rope, *rows.tables(q_lat.dtype), codes, scale=SCALE, interpret=True,
                                 kv_scales=rows.kv_scales())

    def kernel_rows(q_lat, q_rope, new_c, new_r, cache_r):  # the same through `sparse_mla_rows`' dispatch
        rows = cached_rows(cache_c, cache_r, (1,), jnp.int32(length), new_c, new_r, c_scale)
        return sparse_mla_rows(q_lat, q_rope, rows, topk, scale=SCALE, query_block=4, kernels="pallas")

    def dense(new_c, new_r, cache_r):  # slot order: the cache's first `length` slots, then the chunk's rows
        deq = cache_fp8.read_rows(cache_c[1, :, :length], c_scale[1, :, :length], jnp.float32)
        return jnp.concatenate([deq, new_c], 1), jnp.concatenate([cache_r[1, :, :length], new_r], 1)

    def reference(q_lat, q_rope, new_c, new_r, cache_r):
        c_kv, k_rope = dense(new_c, new_r, cache_r)
        return sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, scale=SCALE, query_block=4)

    def reference_lse(q_lat, q_rope, new_c, new_r, cache_r):
        return _reference_lse(q_lat, q_rope, *dense(new_c, new_r, cache_r), topk)

    args = (q_lat, q_rope, new_c, new_r, cache_r)
    out, lse, grads = _value_and_grads(kernel_rows, lambda *a: kernel(*a)[1], args, 5)
    ref_out, ref_lse, ref_grads = _value_and_grads(reference, reference_lse, args, 5)
    assert _rel(out, ref_out) <= RTOL
    real = np.asarray(topk[..., 0] >= 0)
    assert _rel(np.asarray(lse)[real], np.asarray(ref_lse)[real]) <= RTOL
    for name, g, r in zip(("q_lat", "q_rope", "new_c", "new_r"), grads[:4], ref_grads[:4], strict=True):
        assert _rel(g, r) <= RTOL, (name, _rel(g, r))
    assert np.abs(np.asarray(ref_grads[4])).max() > 0 and not np.asarray(grads[4]).any()  # the cache: a constant
    # The jnp FP8 path (`CachedRows` gathering and dequantizing the selected rows) agrees too.
    rows = cached_rows(cache_c, cache_r, (1,), jnp.int32(length), new_c, new_r, c_scale)
    assert _rel(sparse_mla_rows(q_lat, q_rope, rows, topk, scale=SCALE, query_block=4), ref_out) <= RTOL
    with pytest.raises(ValueError, match="kv table 0 with scales must be float8_e4m3fn"):
        sparse_mla_tables(q_lat, q_rope, (new_c.reshape(-1, C),), (new_r.reshape(-1, R),),
                          jnp.zeros((b, s, k), jnp.int32), scale=SCALE, kv_scales=(jnp.ones((b * s,)),))
