"""model/context_parallel.py pieces: the cached partial attention's masked softmax, and its combine over a
slot-sharded cache on an 8-device CPU mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm52_jax.model import context_parallel
from glm52_jax.model.context_parallel import _partial_attention
from glm52_jax.model.kv_cache import SlotLayout


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
        # Device 0 of 2 (slot 0 is its row 0; slot 1 is device 1's), outside any mesh: no combine.
        out = _partial_attention(q_lat, q_rope, topk, cache_c, cache_r, (), c_new, r_new, jnp.int32(1),
                                 jnp.int32(0), SlotLayout(2), 1.0, ())
        return jnp.sum(out), out

    (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q_lat, cache_c, c_new)
    np.testing.assert_array_equal(np.asarray(out), np.full((1, 1, 1, c), -50.0))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads), grads
    np.testing.assert_array_equal(np.asarray(grads[2]), 0.0)  # the masked key gets no gradient
    np.testing.assert_allclose(np.asarray(grads[1]), 1.0)  # softmax over one key: d out / d value = 1


def _dense_attention(q_lat, q_rope, topk, cache_c, cache_r, c_new, r_new, length, scale):
    """One softmax over every selected key (the cache's slots below `length`, then the chunk's rows): what the
    combine over devices must equal."""
    rows_c = jnp.concatenate([cache_c[:, :length], c_new], axis=1)  # [B, length + S, C]
    rows_r = jnp.concatenate([cache_r[:, :length], r_new], axis=1)
    idx = jnp.maximum(topk, 0)
    kv = jax.vmap(lambda r, i: r[i])(rows_c, idx)
    kr = jax.vmap(lambda r, i: r[i])(rows_r, idx)
    logits = (jnp.einsum("bshc,bskc->bshk", q_lat, kv) + jnp.einsum("bshr,bskr->bshk", q_rope, kr)) * scale
    p = jax.nn.softmax(jnp.where((topk >= 0)[:, :, None, :], logits, -jnp.inf), axis=-1)
    return jnp.einsum("bshk,bskc->bshc", p, kv)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("key_block", [8, 64])
def test_partial_attention_over_a_slot_sharded_cache_equals_one_softmax(quantized, key_block):
    """8 devices each hold 8 of 64 cache slots (40 filled; strided, `SlotLayout`: device d holds d, d + 8, ..)
    and attend only to the selected keys they hold, in
    blocks of `key_block` (8: several blocks, the empty ones skipped); the log-sum-exp combine equals one softmax
    over all 24 selected keys (cache rows and the chunk's own 3 rows; some queries select padding, -1), and so
    do the gradients. Quantized: e4m3 rows with per-row scales, against the dequantized rows."""
    from jax.sharding import PartitionSpec as P

    from glm52_jax.model import cache_fp8

    ways, cap, length, b, s, h, c, r, k = 8, 64, 40, 2, 3, 4, 16, 8, 24
    keys = jax.random.split(jax.random.key(0), 6)
    q_lat = jax.random.normal(keys[0], (b, s, h, c))
    q_rope = jax.random.normal(keys[1], (b, s, h, r))
    cache_c = jax.random.normal(keys[2], (b, cap, c))
    cache_r = jax.random.normal(keys[3], (b, cap, r))
    c_new, r_new = jax.random.normal(keys[4], (b, s, c)), jax.random.normal(keys[5], (b, s, r))
    rng = np.random.default_rng(0)
    topk = np.stack([np.stack([rng.permutation(length + s)[:k] for _ in range(s)]) for _ in range(b)])
    topk[0, 1, -5:] = -1  # padding slots
    topk = jnp.asarray(topk, jnp.int32)
    scales = None
    if quantized:
        cache_c, scales = cache_fp8.store_rows((cache_c,), True)
        cache_c, scales = cache_c[0], scales[0]
        dense_c = cache_fp8.read_rows(cache_c, scales, jnp.float32)
    else:
        dense_c = cache_c
    mesh = jax.make_mesh((ways,), ("x",), devices=jax.devices()[:ways])
    slots, rep = P(None, "x"), P()

    def sharded(q_lat, q_rope, cache_c, cache_r, c_new, r_new, scales):
        def per_device(q_lat, q_rope, cache_c, cache_r, c_new, r_new, scales):
            return context_parallel._partial_attention(
                q_lat, q_rope, topk, cache_c, cache_r, (), c_new, r_new, jnp.int32(length),
                jax.lax.axis_index("x"), layout, 0.3, ("x",), scales)

        fn = jax.shard_map(per_device, mesh=mesh, in_specs=(rep, rep, slots, slots, rep, rep,
                                                            None if scales is None else slots),
                           out_specs=rep, check_vma=False)
        return fn(q_lat, q_rope, cache_c, cache_r, c_new, r_new, scales)

    layout = SlotLayout(ways)
    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    strided = lambda a: put(layout.from_slots(a, 1), slots)  # noqa: E731  slot order -> each device's rows
    args = (put(q_lat, rep), put(q_rope, rep), strided(cache_c), strided(cache_r), put(c_new, rep), put(r_new, rep))
    scales = None if scales is None else strided(scales)
    dense = lambda ql, qr, cc, cr, cn, rn: _dense_attention(ql, qr, topk, cc, cr, cn, rn, length, 0.3)  # noqa: E731
    with_block = lambda *a: sharded(*a, scales)  # noqa: E731
    old = context_parallel.KEY_BLOCK
    context_parallel.KEY_BLOCK = key_block
    try:
        got = jax.jit(with_block)(*args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(with_block(*a))), argnums=(0, 1, 3, 4, 5)))(*args)
    finally:
        context_parallel.KEY_BLOCK = old
    want = dense(q_lat, q_rope, dense_c, cache_r, c_new, r_new)
    want_grads = jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), argnums=(0, 1, 3, 4, 5))(
        q_lat, q_rope, dense_c, cache_r, c_new, r_new)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    grads = (*grads[:2], layout.to_slots(np.asarray(grads[2]), 1), *grads[3:])  # the cache rope gradient, slot order
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_own_first_puts_kept_keys_first_and_counts_the_most():
    topk = jnp.asarray([[[5, 1, 7, 3], [2, 6, 0, 4]]], jnp.int32)
    keep = topk % 2 == 1
    order, kept, most = context_parallel.own_first(topk, keep)
    np.testing.assert_array_equal(np.asarray(order), [[[5, 1, 7, 3], [2, 6, 0, 4]]])
    order, kept, most = context_parallel.own_first(topk, topk >= 4)
    np.testing.assert_array_equal(np.asarray(order), [[[5, 7, 1, 3], [6, 4, 2, 0]]])
    np.testing.assert_array_equal(np.asarray(kept), [[[1, 1, 0, 0], [1, 1, 0, 0]]])
    assert int(most) == 2


# ~10 s each (interpret mode): 8 ways is `slow` for CI's budget (tests/parallel/test_cached_kernel.py runs a layer over
# an 8-way strided cache on the kernel in CI).
@pytest.mark.parametrize(("ways", "shared", "quantized"), [pytest.param(8, False, False, marks=pytest.mark.slow),
                                                           (4, True, False), (4, False, True)])
def test_kernel_partial_attention_equals_the_gathered_one(ways, shared, quantized):
    """kernels="pallas" (the sparse MLA kernel, interpret mode here): each device's blocks of kept keys run on
    `sparse_mla_tables` over its local stack (read in place at stack index (1,), local row = slot // ways) and the
    chunk's rows, and the log-sum-exp combine of the kernel's (out, lse) equals the gathered jnp path, output and
    gradients (q, the cache's rows, the chunk's rows), on the slot shards of both test meshes (8: folded=8, 4:
    context=4). Key blocks of 4 (several per device, empty ones skipped); one query selects only device 0's slots
    (every other device has no key for it), one selects nothing (output 0), one has padding slots. `shared`: one
    batch-1 stack read by both rows (`shared_cache`'s prompt), the chunk rows each row's suffix. `quantized`: an FP8
    cache (e4m3 c_kv rows and their scales, sharded alike) read in place by the kernel against the jnp FP8 path
    (gathered rows dequantized); the cache is a constant for the kernel (zero gradient), q and the chunk's rows
    get the same gradients."""
    from jax.sharding import PartitionSpec as P

    from glm52_jax.model import cache_fp8

    cap, length, b, s, h, c, r, k = 32, 20, 2, 3, 4, 16, 16, 12
    keys = jax.random.split(jax.random.key(1), 6)
    q_lat = jax.random.normal(keys[0], (b, s, h, c))
    q_rope = jax.random.normal(keys[1], (b, s, h, r))
    cache_b = 1 if shared else b
    cache_c = jax.random.normal(keys[2], (2, cache_b, cap, c))  # [stack, B, Cap, C]: the layer is stack index 1
    cache_r = jax.random.normal(keys[3], (2, cache_b, cap, r))
    c_new, r_new = jax.random.normal(keys[4], (b, s, c)), jax.random.normal(keys[5], (b, s, r))
    scales = None
    if quantized:  # rows of different magnitudes (1x to 4x): each needs its own scale
        cache_c, scales = cache_fp8.quantize_rows(cache_c * (1.0 + jnp.arange(cap, dtype=jnp.float32) % 4)[:, None])
    rng = np.random.default_rng(1)
    topk = np.stack([np.stack([rng.permutation(length + s)[:k] for _ in range(s)]) for _ in range(b)])
    topk[0, 1, -5:] = -1  # padding slots
    topk[1, 0] = -1  # no key at all
    topk[1, 2] = -1
    topk[1, 2, :3] = np.arange(3) * ways  # device 0's slots only
    topk = jnp.asarray(topk, jnp.int32)
    layout = SlotLayout(ways)
    mesh = jax.make_mesh((ways,), ("x",), devices=jax.devices()[:ways])
    slots, rep = P(None, None, "x"), P()

    def attention(kernels):
        def per_device(q_lat, q_rope, cache_c, cache_r, c_new, r_new, scales):
            return context_parallel._partial_attention(
                q_lat, q_rope, topk, cache_c, cache_r, (1,), c_new, r_new, jnp.int32(length),
                jax.lax.axis_index("x"), layout, 0.3, ("x",), scales, kernels=kernels)

        return jax.shard_map(per_device, mesh=mesh, in_specs=(rep, rep, slots, slots, rep, rep,
                                                              None if scales is None else P(None, None, "x")),
                             out_specs=rep, check_vma=False)

    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    args = (put(q_lat, rep), put(q_rope, rep), put(layout.from_slots(cache_c, 2), slots),
            put(layout.from_slots(cache_r, 2), slots), put(c_new, rep), put(r_new, rep),
            None if scales is None else put(layout.from_slots(scales, 2), P(None, None, "x")))
    names = ("q_lat", "q_rope", "cache_c", "cache_r", "c_new", "r_new")
    diff = (0, 1, 3, 4, 5) if quantized else tuple(range(6))  # (no gradient of e4m3 rows)
    old = context_parallel.KEY_BLOCK
    context_parallel.KEY_BLOCK = 4
    try:
        assert "pallas_call" in str(jax.make_jaxpr(attention("pallas"))(*args))
        results = []
        for kernels in ("pallas", "reference"):  # one program each: the output rides along as the loss's aux
            fn = attention(kernels)
            loss = lambda *a, fn=fn: (jnp.sum(jnp.sin(out := fn(*a))), out)  # noqa: E731
            (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=diff, has_aux=True))(*args)
            results.append((out, dict(zip((names[i] for i in diff), grads, strict=True))))
    finally:
        context_parallel.KEY_BLOCK = old
    (got, got_grads), (want, want_grads) = results
    np.testing.assert_array_equal(np.asarray(want)[1, 0], 0.0)  # the query with no key
    assert np.abs(np.asarray(want)[1, 2]).min() > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if quantized:  # the FP8 cache's tables are constants for the kernel; the jnp path differentiates its k_rope
        want_r, got_r = (np.asarray(g.pop("cache_r")) for g in (want_grads, got_grads))
        assert np.abs(want_r).max() > 0 and not got_r.any()
    for name, w in want_grads.items():
        assert np.abs(np.asarray(w)).max() > 0, name
        np.testing.assert_allclose(np.asarray(got_grads[name]), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)
