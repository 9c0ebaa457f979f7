"""The Pallas indexer scoring kernel (interpret mode on CPU) against the jnp reference.

Scores: float32 inputs agree with `block_scores` + the causal mask to float32 rounding (the head sum
and the dot run in another order); bf16 inputs score the bf16-rounded values, with the same tolerance
against the reference on those values. Top-k: with kernels="pallas" the index arrays (order included)
equal the reference's exactly in float32: ragged query / key tails, k larger than the visible
positions, fully masked rows, the cached variant (read in place, capacity not a multiple of the
block) and ties to the lowest key index; IndexShare layers keep reusing the full layers' top-k.
The kernel path merges each key block by radix select (indexer_select), checked against lax.top_k
merges on heavily tied scores.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from indexer_inputs import indexer_inputs as _inputs

from glm52_jax.config import tiny
from glm52_jax.kernels import indexer as kernel
from glm52_jax.kernels import indexer_select as kernel_select
from glm52_jax.model.indexer import INVALID, block_scores, cached_topk, streaming_topk
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa

SCALE = 0.25
# float32 scores: the kernel sums heads and dot products in another order than XLA's einsums.
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def _reference_scores(q, w, k, q_pos, k_pos):
    scores = block_scores(q, w, k, SCALE)
    return jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], scores, -jnp.inf)


def _assert_scores_equal(ours, ref, **tol):
    ours, ref = np.asarray(ours), np.asarray(ref)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(ours[finite], ref[finite], **tol)


@pytest.fixture(scope="module")
def window():
    """37 queries at positions 40..76 against key rows 30..93 of 90 keys: the window runs past the
    key array (rows 90..93 are masked) and is not a multiple of the key tile; some tiles lie wholly
    above the causal diagonal (skipped) and some straddle it."""
    q, w, _ = _inputs(0)
    _, _, k = _inputs(1, t=90)
    q_pos = 40 + jnp.arange(37, dtype=jnp.int32)
    k_pos = jnp.arange(90, dtype=jnp.int32)
    return q, w, k, q_pos, k_pos


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scores_match_reference(window, dtype):
    q, w, k, q_pos, k_pos = window
    q, k = q.astype(dtype), k.astype(dtype)
    ours = kernel.index_scores(q, w, q_pos, k, k_pos, jnp.int32(30), 64, scale=SCALE)
    rows = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 4), (0, 0)))[:, 30:94]
    row_pos = jnp.pad(k_pos, (0, 4), constant_values=jnp.iinfo(jnp.int32).max)[30:94]
    ref = _reference_scores(q.astype(jnp.float32), w, rows, q_pos, row_pos)
    assert ours.shape == (2, 37, 64) and ours.dtype == jnp.float32
    _assert_scores_equal(ours, ref, **F32_TOL)
    assert np.isneginf(np.asarray(ours)[:, :, 60:]).all()  # rows past the keys
    assert np.isfinite(np.asarray(ours)).any()


def _e4m3_oracle(x):
    """numpy's quantize_e4m3: per-row scale amax / 448 (1 for a zero row), values rounded to e4m3 (ml_dtypes),
    each division the product by the float32 reciprocal, as the rule states."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax > 0, amax * np.float32(1.0 / 448.0), np.float32(1.0)).astype(np.float32)
    values = (x * (np.float32(1.0) / scale)[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return values, scale


def _fp8_oracle_scores(q, w, k, q_pos, k_pos):
    """numpy FP8 index scores [B,S,T]: e4m3 q per (token, head) and k per row, the float32 dots of the e4m3
    values, relu, the head sum weighted by w x the query scales, times the key scales; -inf where not visible."""
    q8, sq = _e4m3_oracle(q)
    k8, sk = _e4m3_oracle(k)
    logits = np.einsum("bshi,bti->bsht", q8.astype(np.float64), k8.astype(np.float64)) * SCALE
    scores = np.einsum("bsh,bsht->bst", np.asarray(w, np.float64) * sq, np.maximum(logits, 0.0)) * sk[:, None, :]
    visible = np.asarray(k_pos)[None, None, :] <= np.asarray(q_pos)[None, :, None]
    return np.where(visible, scores, -np.inf)


def test_fp8_topk_equals_numpy_oracle():
    """indexer_dtype="fp8": the interpret-mode kernel (Pallas) and the jnp reference select exactly the oracle's
    top-k with its scores (float32 rounding: the kernel sums in another order) in each path: a sequence's
    keys (quantized once per call; the kernel reads them with their stored scales), a float32 cache stack (each
    row quantized as the kernel loads it), and (reference) an e4m3 cache stack with its scales read as stored
    (`cache_fp8`, the same rule). The FP8 scores stay within a
    few percent of the unquantized ones."""
    from glm52_jax.model.cache_fp8 import quantize_rows

    q, w, k = _inputs(10, b=1, s=12, t=20)
    pos = 8 + jnp.arange(12, dtype=jnp.int32)
    k_pos = jnp.arange(20, dtype=jnp.int32)
    kk = 6

    def oracle_topk(q_pos):  # ties (zero scores) to the lowest key index, as the merges keep them
        oracle = _fp8_oracle_scores(q, w, k, q_pos, k_pos)
        order = np.argsort(-oracle, axis=-1, kind="stable")[..., :kk]
        vals = np.take_along_axis(oracle, order, -1)
        return np.where(np.isneginf(vals), INVALID, order), vals.astype(np.float32)

    blocks = dict(scale=SCALE, query_block=8, key_block=8, indexer_dtype="fp8")
    stack = jnp.zeros((2, 1, 24, 16), jnp.float32).at[1, :, :20].set(k)  # [F, B, Cap, I], slots 20.. unwritten
    values, scales = quantize_rows(stack)
    cached = dict(index=(1,), q_pos=pos + 20, length=jnp.int32(20), topk=kk, **blocks)
    results = {kernels: streaming_topk(q, w, k, pos, k_pos, kk, return_scores=True, kernels=kernels, **blocks)[::-1]
               for kernels in ("reference", "pallas")}
    for kernels in ("reference", "pallas"):
        results[f"{kernels} f32 cache"] = cached_topk(q, w, stack, kernels=kernels, **cached)[::-1]
    # The kernel's stored-scale path is the sequence's above (k_scale); the e4m3 cache's reference read here.
    results["reference e4m3 cache"] = cached_topk(q, w, values, key_scales=scales, **cached)[::-1]
    causal, after = oracle_topk(pos), oracle_topk(pos + 20)  # a cache's queries see all 20 filled slots
    for name, (idx, vals) in results.items():
        ref_idx, ref_vals = after if "cache" in name else causal
        np.testing.assert_array_equal(np.asarray(idx), ref_idx, err_msg=name)
        _assert_scores_equal(vals, ref_vals, **F32_TOL)
    oracle = _fp8_oracle_scores(q, w, k, pos, k_pos)
    exact = np.asarray(_reference_scores(q, w, k, pos, k_pos))
    finite = np.isfinite(exact)
    err = np.abs(oracle[finite] - exact[finite]).max() / np.abs(exact[finite]).max()
    assert 0 < err < 0.1


def _rescored_oracle(q, w, k, q_pos, k_pos, kk, m):
    """numpy selection of FP8 scoring with M candidates rescored: the oracle FP8 scores' best m per query (ties to
    the lower key), then of those the best kk by the unquantized float64 scores (ties to the lower key)."""
    fp8 = _fp8_oracle_scores(q, w, k, q_pos, k_pos)
    logits = np.einsum("bshi,bti->bsht", np.asarray(q, np.float64), np.asarray(k, np.float64)) * SCALE
    exact = np.einsum("bsh,bsht->bst", np.asarray(w, np.float64), np.maximum(logits, 0.0))
    exact = np.where(np.isneginf(fp8), -np.inf, exact)
    keep = np.sort(np.argsort(-fp8, axis=-1, kind="stable")[..., :m], axis=-1)
    kept = np.where(np.isneginf(np.take_along_axis(fp8, keep, -1)), -np.inf, np.take_along_axis(exact, keep, -1))
    order = np.argsort(-kept, axis=-1, kind="stable")[..., :kk]
    vals = np.take_along_axis(kept, order, -1)
    return np.where(np.isneginf(vals), INVALID, np.take_along_axis(keep, order, -1)), vals


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_fp8_candidates_rescored_equal_the_oracle(kernels):
    """indexer_dtype="fp8" with `candidates`: the FP8 loop keeps M keys per query and the best K of them by their
    unquantized scores are selected. With M = 8 over K = 6 (a narrow margin) the selection is the oracle's, for a
    sequence's keys and a float32 cache stack; with M = 20 (every key) it is bf16 scoring's own selection and
    scores."""
    q, w, k = _inputs(10, b=1, s=12, t=20)
    pos = 8 + jnp.arange(12, dtype=jnp.int32)
    k_pos = jnp.arange(20, dtype=jnp.int32)
    kk = 6
    blocks = dict(scale=SCALE, query_block=8, key_block=8, kernels=kernels)
    stack = jnp.zeros((2, 1, 24, 16), jnp.float32).at[1, :, :20].set(k)
    cached = dict(index=(1,), q_pos=pos + 20, length=jnp.int32(20), topk=kk, **blocks)
    for m in (8, 20):
        fp8 = dict(indexer_dtype="fp8", candidates=m)
        got = {"sequence": streaming_topk(q, w, k, pos, k_pos, kk, return_scores=True, **blocks, **fp8)[::-1],
               "cache": cached_topk(q, w, stack, **cached, **fp8)[::-1]}
        for name, (idx, vals) in got.items():
            q_pos = pos + 20 if name == "cache" else pos
            want_idx, want_vals = _rescored_oracle(q, w, k, q_pos, k_pos, kk, m)
            np.testing.assert_array_equal(np.asarray(idx), want_idx, err_msg=f"{name}, M={m}")
            _assert_scores_equal(vals, want_vals.astype(np.float32), **F32_TOL)
        if m == 20:
            bf16 = streaming_topk(q, w, k, pos, k_pos, kk, return_scores=True, **blocks)
            np.testing.assert_array_equal(np.asarray(got["sequence"][0]), np.asarray(bf16[1]))
            _assert_scores_equal(got["sequence"][1], bf16[0], **F32_TOL)
    # FP8's own top 6 is not bf16's here, so the M = 20 equality above is the rescoring's doing.
    fp8_only = np.asarray(streaming_topk(q, w, k, pos, k_pos, kk, indexer_dtype="fp8", **blocks))
    assert (fp8_only != np.asarray(streaming_topk(q, w, k, pos, k_pos, kk, **blocks))).any()


def test_fp8_candidates_over_an_e4m3_cache_rescore_the_dequantized_rows():
    """An FP8 cache (e4m3 rows + scales) with FP8 scoring and every slot a candidate: the selection is bf16
    scoring's of the dequantized rows (what the cache holds), read in place from the stack."""
    from glm52_jax.model.cache_fp8 import quantize_rows

    q, w, _ = _inputs(8, s=3)
    keys, scales = quantize_rows(jax.random.normal(jax.random.key(9), (2, 2, 2, 41, 16), jnp.float32) * 3.0)
    length = jnp.asarray(35, jnp.int32)
    q_pos = 35 + jnp.arange(3, dtype=jnp.int32)
    args = dict(scale=SCALE, query_block=4, key_block=16, key_scales=scales)
    vals, idx = cached_topk(q, w, keys, (1, 0), q_pos, length, 8, indexer_dtype="fp8", candidates=41, **args)
    ref_vals, ref_idx = cached_topk(q, w, keys, (1, 0), q_pos, length, 8, **args)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    _assert_scores_equal(vals, ref_vals, **F32_TOL)


def test_fp8_candidates_are_checked():
    q, w, k = _inputs(1, b=1, s=4, t=12)
    pos = jnp.arange(12, dtype=jnp.int32)
    with pytest.raises(ValueError, match="must exceed the top-k"):
        streaming_topk(q, w, k, pos[8:], pos, 6, scale=SCALE, query_block=4, key_block=4, indexer_dtype="fp8",
                       candidates=6)
    with pytest.raises(ValueError, match="rescores nothing"):
        GlmMoeDsa(tiny(), ModelOptions(indexer_dtype="fp8", indexer_candidates=16), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("query_block,key_block,topk", [(8, 4, 7), (64, 3, 50), (16, 16, 16)])
def test_streaming_topk_equals_reference(query_block, key_block, topk):
    """Ragged tails (37 = 2x16 + 5 queries, 37 keys), k above the visible count for early rows and
    above all 37 keys (50: K = min(50, 37), INVALID padding)."""
    q, w, k = _inputs(2)
    pos = jnp.arange(37, dtype=jnp.int32)
    args = dict(scale=SCALE, query_block=query_block, key_block=key_block, return_scores=True)
    ref_vals, ref_idx = streaming_topk(q, w, k, pos, pos, topk, **args)
    vals, idx = streaming_topk(q, w, k, pos, pos, topk, kernels="pallas", **args)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    _assert_scores_equal(vals, ref_vals, **F32_TOL)
    assert (np.asarray(idx) == INVALID).any() == (topk > 1)


def test_fully_masked_rows():
    """Queries before every key (positions -3..-1) get INVALID everywhere, as in the reference."""
    q, w, k = _inputs(3, s=9, t=20)
    q_pos = jnp.arange(9, dtype=jnp.int32) - 3
    k_pos = jnp.arange(20, dtype=jnp.int32)
    args = dict(scale=SCALE, query_block=4, key_block=8, return_scores=True)
    ref_vals, ref_idx = streaming_topk(q, w, k, q_pos, k_pos, 5, **args)
    vals, idx = streaming_topk(q, w, k, q_pos, k_pos, 5, kernels="pallas", **args)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    assert (np.asarray(idx)[:, :3] == INVALID).all() and np.isneginf(np.asarray(vals)[:, :3]).all()
    _assert_scores_equal(vals, ref_vals, **F32_TOL)


@pytest.mark.parametrize("num_queries", [1, 4])
def test_cached_topk_equals_reference(num_queries):
    """A stacked cache [reps=2, F=2, B, Cap=41, I] read in place at (1, 0); 35 filled slots, key
    block 16 (divides neither); decode (1 query) and a 4-query chunk."""
    q, w, _ = _inputs(4, s=num_queries)
    stack = jax.random.normal(jax.random.key(5), (2, 2, 2, 41, 16), jnp.float32)
    length = jnp.asarray(35, jnp.int32)
    q_pos = 35 + jnp.arange(num_queries, dtype=jnp.int32)
    args = dict(scale=SCALE, query_block=4, key_block=16)
    ref_vals, ref_idx = cached_topk(q, w, stack, (1, 0), q_pos, length, 8, **args)
    vals, idx = cached_topk(q, w, stack, (1, 0), q_pos, length, 8, kernels="pallas", **args)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    _assert_scores_equal(vals, ref_vals, **F32_TOL)
    assert np.asarray(idx).max() < 35  # never an unwritten slot


def test_cached_topk_over_fp8_keys_equals_reference():
    """An FP8 cache's e4m3 key stack and per-row scales (`model/cache_fp8.py`) read in place by a decode query:
    the kernel casts the keys to the query's float32 and scales each key's score, the reference dequantizes each
    key block; the same top-k (scores to float32 rounding), never an unwritten slot."""
    from glm52_jax.model.cache_fp8 import quantize_rows

    num_queries = 1
    q, w, _ = _inputs(8, s=num_queries)
    keys, scales = quantize_rows(jax.random.normal(jax.random.key(9), (2, 2, 2, 41, 16), jnp.float32) * 3.0)
    length = jnp.asarray(35, jnp.int32)
    q_pos = 35 + jnp.arange(num_queries, dtype=jnp.int32)
    args = dict(scale=SCALE, query_block=4, key_block=16, key_scales=scales)
    ref_vals, ref_idx = cached_topk(q, w, keys, (1, 0), q_pos, length, 8, **args)
    vals, idx = cached_topk(q, w, keys, (1, 0), q_pos, length, 8, kernels="pallas", **args)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    _assert_scores_equal(vals, ref_vals, **F32_TOL)
    assert np.asarray(idx).max() < 35


def test_select_merge_equals_sorting_merge_with_ties():
    """The radix-select merge against lax.top_k merges over 4 blocks of scores drawn from a handful of
    values (-inf, -0.0, +0.0, 1, 2: ties at every threshold, signed zeros) for k = 5 (kept as 8) and
    k = 13 (a block of 24 padded to 32): same values and indices, in the reference's order."""
    choices = jnp.array([-jnp.inf, -0.0, 0.0, 1.0, 2.0], jnp.float32)
    blocks = jax.random.choice(jax.random.key(7), choices, (4, 2, 19, 24))  # [block, B, rows, kb]
    for k in (5, 13):
        ref = (jnp.full((2, 19, k), -jnp.inf), jnp.full((2, 19, k), INVALID, jnp.int32))
        running = kernel_select.init_running(2, 19, kernel_select.next_pow2(k))
        for j, scores in enumerate(blocks):
            kidx = 24 * j + jnp.arange(24, dtype=jnp.int32)
            vals = jnp.concatenate([ref[0], scores], axis=-1)
            idxs = jnp.concatenate([ref[1], jnp.broadcast_to(kidx, scores.shape)], axis=-1)
            best, pos = jax.lax.top_k(vals, k)
            ref = (best, jnp.take_along_axis(idxs, pos, axis=-1))
            running = kernel_select.merge_select(running, scores, kidx[0])
        vals, idx = kernel_select.finish(running, k)
        ref_idx = jnp.where(jnp.isneginf(ref[0]), INVALID, ref[1])
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
        np.testing.assert_array_equal(np.signbit(np.asarray(vals)), np.signbit(np.asarray(ref[0])))
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref[0]))


def test_ties_keep_lowest_key_index():
    """Equal scores everywhere: the kernel path keeps the earliest keys, across key blocks too."""
    q = jnp.ones((1, 12, 2, 4))
    w = jnp.ones((1, 12, 2))
    k = jnp.ones((1, 40, 4))
    pos = jnp.arange(12, dtype=jnp.int32)
    idx = np.asarray(streaming_topk(q, w, k, pos, jnp.arange(40, dtype=jnp.int32), 3, scale=1.0, query_block=5,
                                    key_block=2, kernels="pallas"))
    for qi in range(12):
        visible = min(qi + 1, 3)
        assert idx[0, qi].tolist() == list(range(visible)) + [INVALID] * (3 - visible)


def test_model_topk_with_indexshare():
    """Tiny model, 4 layers (IndexShare: layers 0, 1, 3 own an indexer, shared layer 2 reuses layer
    1's top-k), float32: with kernels="pallas" every full layer's top-k equals the
    reference's, and so do the hidden states (which the shared layers' reuse feeds)."""
    cfg = tiny(num_hidden_layers=4, indexer_types=("full", "full", "shared", "full"))
    ids = jax.random.randint(jax.random.key(6), (1, 40), 0, cfg.vocab_size)  # 40 tokens > index_topk 32
    out = {}
    for kernels in ("reference", "pallas"):
        model = GlmMoeDsa(cfg, ModelOptions(param_dtype=jnp.float32, kernels=kernels), rngs=nnx.Rngs(0))
        out[kernels] = model.hidden_states(ids, return_topk=True)
    (h_ref, topk_ref), (h, topk) = out["reference"], out["pallas"]
    full_layers = [i for i, kind in enumerate(cfg.indexer_types) if kind == "full"]
    assert sorted(topk) == sorted(topk_ref) == full_layers
    for layer in topk_ref:
        np.testing.assert_array_equal(np.asarray(topk[layer]), np.asarray(topk_ref[layer]))
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), rtol=1e-5, atol=1e-5)
