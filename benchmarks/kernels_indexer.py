"""Indexer section of the GPU kernel benchmark (benchmarks/kernels_gpu.py calls `bench`).

Outside the package: it compares the kernels (glm52_jax.kernels) with the model's reference code
(glm52_jax.model.indexer), and the model imports the kernels.

Each function returns a list of row dicts (JSON-ready). Timings are the best of `reps` runs of a
jitted call after one warm-up (compile excluded). FLOPs count only the useful scoring work: the
per-(query, key) dot products over all heads, causal pairs only (2 * H * I per pair); relu, head
weighting, masking and the top-k run on vector units and are not counted (as in benchmarks/roofline.py).

    check(...)        kernel vs reference on the GPU: float32 top-k equality, bf16 overlap and score error
    scoring(...)      the fused scoring kernel alone on one query group x key chunk
    topk(...)         whole causal top-k (kernel + XLA merge vs the jnp reference), prefill shapes
    decode(...)       cached top-k for G rows of one query against a cache of T keys
    fp8_overlap(...)  top-k overlap of FP8 (e4m3, per-row scales) scoring against bf16
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm52_jax.kernels import indexer as kernel
from glm52_jax.model.indexer import cached_topk, streaming_topk


@dataclasses.dataclass(frozen=True)
class Dims:
    heads: int = 32  # GLM-5.2's indexer: 32 heads x 128, top-2048
    dim: int = 128
    topk: int = 2048


GLM = Dims()
SMOKE = Dims(heads=2, dim=16, topk=8)


def _time(fn, *args, reps: int = 3) -> float:
    """Best wall time (s) of `fn(*args)` over `reps` runs after a warm-up call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _inputs(seed: int, batch: int, seq: int, keys: int, d: Dims, dtype=jnp.bfloat16):
    """Random indexer inputs: q [B,S,H,I] and k [B,T,I] in `dtype` held as float32 (as the model
    passes them), w [B,S,H] float32."""
    kq, kw, kk = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, seq, d.heads, d.dim), jnp.float32).astype(dtype).astype(jnp.float32)
    w = jax.random.normal(kw, (batch, seq, d.heads), jnp.float32) * d.heads ** -0.5
    k = jax.random.normal(kk, (batch, keys, d.dim), jnp.float32).astype(dtype).astype(jnp.float32)
    return q, w, k


def _causal_pairs(seq: int, keys: int) -> int:
    """(query, key) pairs with key <= query when the queries are the last `seq` of `keys` positions."""
    first = keys - seq
    return sum(min(first + s + 1, keys) for s in range(seq))


def _row(name: str, shape: dict, seconds: float, flops: float | None, peak_tflops: float | None, **extra) -> dict:
    row = {"section": "indexer", "name": name, **shape, "seconds": seconds, "ms": round(seconds * 1e3, 3)}
    if flops is not None:
        tflops = flops / seconds / 1e12
        row["tflops"] = round(tflops, 1)
        if peak_tflops:
            row["fraction_of_peak"] = round(tflops / peak_tflops, 3)
    row.update(extra)
    return row


def _topk_fn(kernels: str, topk: int, score_dtype, d: Dims, query_block: int = 128, key_block: int = 512,
             indexer_dtype: str = "bf16", candidates: int = 0):
    def fn(q, w, k):
        pos = jnp.arange(q.shape[1], dtype=jnp.int32)
        return streaming_topk(q, w, k, pos, pos, topk, scale=d.dim ** -0.5, query_block=query_block,
                              key_block=key_block, kernels=kernels, score_dtype=score_dtype,
                              indexer_dtype=indexer_dtype, candidates=candidates)
    return jax.jit(fn)


def check(seq: int = 2048, topk: int = 256, d: Dims = GLM) -> list[dict]:
    """Kernel vs reference on this device: float32 (HIGHEST matmul precision) index arrays must be
    equal; bf16 kernel vs float32 reference: top-k overlap."""
    q, w, k = _inputs(0, 1, seq, seq, d)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(_topk_fn("reference", topk, None, d)(q, w, k))
        f32 = np.asarray(_topk_fn("pallas", topk, jnp.float32, d)(q, w, k))
    bf16 = np.asarray(_topk_fn("pallas", topk, jnp.bfloat16, d)(q, w, k))
    return [{"section": "indexer", "name": "check", "seq": seq, "topk": topk,
             "f32_equal": bool(np.array_equal(ref, f32)),
             "f32_rows_differing": int((ref != f32).any(-1).sum()),
             "index_overlap": round(_overlap(ref, bf16), 6)}]


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of |set(a) & set(b)| / |set(a)| (INVALID slots ignored)."""
    total, n = 0.0, 0
    for ra, rb in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
        sa, sb = set(ra[ra >= 0].tolist()), set(rb[rb >= 0].tolist())
        if sa:
            total += len(sa & sb) / len(sa)
            n += 1
    return total / max(n, 1)


def scoring(groups=((2048, 32768),), peak_tflops: float | None = None, tilings=(None,), d: Dims = GLM) -> list[dict]:
    """The scoring kernel alone: a query group of `sq` queries after all `keys` keys (every pair visible)."""
    rows = []
    for sq, keys in groups:
        q, w, k = _inputs(1, 1, sq, keys, d)
        qb, kb = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
        q_pos = jnp.full((sq,), keys, jnp.int32)
        k_pos = jnp.arange(keys, dtype=jnp.int32)
        for tiles in tilings:
            fn = jax.jit(functools.partial(_scores, q_pos=q_pos, k_pos=k_pos, tiles=tiles, scale=d.dim ** -0.5))
            t = kernel.tiling() if tiles is None else tiles
            shape = {"queries": sq, "keys": keys, "tiling": f"{t.tile_q}x{t.tile_k}/w{t.num_warps}/s{t.num_stages}"}
            try:  # one tiling failing to compile (e.g. shared memory) must not lose the others
                seconds = _time(fn, qb, w, kb)
            except Exception as err:  # noqa: BLE001
                rows.append({"section": "indexer", "name": "scoring_kernel", **shape, "error": str(err)[:300]})
                continue
            rows.append(_row("scoring_kernel", shape, seconds, 2.0 * d.heads * d.dim * sq * keys, peak_tflops))
    return rows


def _scores(q, w, k, *, q_pos, k_pos, tiles, scale):
    return kernel.index_scores(q, w, q_pos, k, k_pos, 0, k.shape[1], scale=scale, tiles=tiles)


def _decode(q, w, cache, *, kernels: str, d: Dims):
    keys = cache.shape[-2]
    qpos = jnp.full((1,), keys, jnp.int32)
    return cached_topk(q, w, cache, (0, 0), qpos, jnp.asarray(keys, jnp.int32), d.topk, scale=d.dim ** -0.5,
                       query_block=128, key_block=512, kernels=kernels, score_dtype=jnp.bfloat16)


def topk(seqs=(8192,), peak_tflops: float | None = None, reference_up_to: int = 16384, d: Dims = GLM) -> list[dict]:
    """Causal top-k over a whole sequence (one device's queries = keys): kernel path vs reference, and the kernel
    path with FP8 scoring: its own top-k ("pallas_fp8") and 2 x K candidates rescored ("pallas_fp8c", what
    configs/2m.py runs), with the fraction of bf16's selection each keeps (the rescored one should keep it all)."""
    rows = []
    for seq in seqs:
        q, w, k = _inputs(2, 1, seq, seq, d)
        flops = 2.0 * d.heads * d.dim * _causal_pairs(seq, seq)
        impls = [("pallas", jnp.bfloat16, "bf16", 0), ("pallas_fp8", jnp.bfloat16, "fp8", 0),
                 ("pallas_fp8c", jnp.bfloat16, "fp8", 2 * d.topk)]
        impls += [("reference", None, "bf16", 0)] if seq <= reference_up_to else []
        selected = {}
        for name, dtype, indexer_dtype, candidates in impls:
            fn = _topk_fn(name.split("_")[0], d.topk, dtype, d, indexer_dtype=indexer_dtype, candidates=candidates)
            seconds = _time(fn, q, w, k, reps=2)
            selected[name] = np.asarray(fn(q, w, k))
            extra = {} if name == "pallas" else {"overlap_with_bf16": round(_overlap(selected["pallas"],
                                                                                     selected[name]), 6)}
            rows.append(_row(f"topk_{name}", {"seq": seq, "topk": d.topk}, seconds, flops, peak_tflops, **extra))
    return rows


def decode(cases=((2, 32768), (8, 32768), (2, 131072), (8, 131072)), peak_tflops: float | None = None,
           d: Dims = GLM) -> list[dict]:
    """One decode step's indexer: G rows x 1 query against a float32 cache of T filled slots."""
    rows = []
    for rows_g, keys in cases:
        q, w, _ = _inputs(3, rows_g, 1, 1, d)
        cache = jax.random.normal(jax.random.key(4), (1, 1, rows_g, keys, d.dim), jnp.float32)
        for name in ("pallas", "reference"):
            seconds = _time(jax.jit(functools.partial(_decode, kernels=name, d=d)), q, w, cache)
            rows.append(_row(f"decode_{name}", {"rows": rows_g, "keys": keys, "topk": d.topk}, seconds,
                             2.0 * d.heads * d.dim * rows_g * keys, peak_tflops,
                             cache_gbps=round(cache.nbytes / seconds / 1e9, 1)))
    return rows


def fp8_overlap(seq: int = 4096, d: Dims = GLM) -> list[dict]:
    """Top-k overlap of FP8 e4m3 scoring (per-row scales, DeepSeek's indexer recipe) with bf16
    scoring on random real-shaped inputs: all `seq` queries over `seq` causal keys, rows with at
    least top-k visible keys."""
    q, w, k = _inputs(5, 1, seq, seq, d)
    pos = jnp.arange(seq, dtype=jnp.int32)
    scale = d.dim ** -0.5

    @jax.jit
    def both(q, w, k):
        bf16 = kernel.index_scores(q.astype(jnp.bfloat16), w, pos, k.astype(jnp.bfloat16), pos, 0, seq, scale=scale)
        q8, q_scale = kernel.quantize_e4m3(q)  # [B,S,H,I], [B,S,H]
        k8, k_scale = kernel.quantize_e4m3(k)  # [B,T,I], [B,T]
        fp8 = kernel.index_scores(q8, w * q_scale, pos, k8, pos, 0, seq, scale=scale, k_scale=k_scale)
        return jax.lax.top_k(bf16, d.topk)[1], jax.lax.top_k(fp8, d.topk)[1], bf16, fp8

    a, b, s_bf16, s_fp8 = (np.asarray(x) for x in both(q, w, k))
    full = np.arange(seq) >= d.topk - 1  # queries with at least top-k visible keys
    per_row = [_overlap(a[:, i:i + 1], b[:, i:i + 1]) for i in np.nonzero(full)[0]]
    visible = np.isfinite(s_bf16)
    rel = np.abs(s_fp8[visible] - s_bf16[visible]).max() / np.abs(s_bf16[visible]).max()
    return [{"section": "indexer", "name": "fp8_overlap", "seq": seq, "topk": d.topk,
             "index_overlap": round(float(np.mean(per_row)), 4), "index_overlap_min": round(min(per_row), 4),
             "max_score_err_rel_to_max": float(rel)}]


def bench(smoke: bool = False, peak_tflops: float | None = None, deadline: float | None = None) -> list[dict]:
    """The indexer section for benchmarks/kernels_gpu.py: every part above at GLM-5.2's indexer shapes
    (32 heads x 128, top-2048; 8K-64K keys per device, decode with G = 2 and 8 at 32K / 128K), or at
    tiny shapes in interpret mode with `smoke`. Parts are skipped once `deadline` (time.time()) is
    20 s away; a part that fails records its error and the others still run."""
    if smoke:
        d = SMOKE
        parts = [("check", lambda: check(seq=40, topk=8, d=d)),
                 ("scoring", lambda: scoring(groups=((32, 64),), peak_tflops=peak_tflops, d=d)),
                 ("topk", lambda: topk(seqs=(40,), peak_tflops=peak_tflops, d=d)),
                 ("decode", lambda: decode(cases=((2, 50),), peak_tflops=peak_tflops, d=d)),
                 ("fp8_overlap", lambda: fp8_overlap(seq=32, d=d))]
    else:
        parts = [("check", check),
                 ("scoring", lambda: scoring(peak_tflops=peak_tflops)),
                 ("topk", lambda: topk(seqs=(8192, 16384), peak_tflops=peak_tflops, reference_up_to=16384)),
                 ("decode", lambda: decode(peak_tflops=peak_tflops)),
                 ("fp8_overlap", fp8_overlap),
                 ("topk_long", lambda: topk(seqs=(32768, 65536), peak_tflops=peak_tflops, reference_up_to=0))]
    rows = []
    for name, part in parts:
        if deadline is not None and time.time() > deadline - 20:
            rows.append({"section": "indexer", "name": name, "skipped": "time budget"})
            continue
        try:
            rows.extend(part())
        except Exception as err:  # noqa: BLE001  (one failing part must not lose the others)
            rows.append({"section": "indexer", "name": name, "error": f"{type(err).__name__}: {str(err)[:500]}"})
    return rows
