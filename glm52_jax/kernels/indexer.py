"""Fused DSA indexer scoring kernel (Pallas, Triton backend).

For a block of queries and a chunk of keys the kernel computes the masked index scores

    score[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t] * scale)   if key_pos[t] <= q_pos[s]
                   = -inf                                                  otherwise

exactly as `model.indexer.block_scores` + the causal mask: the per-head dots on tensor cores in the
keys' dtype with float32 accumulation, relu, the weighted head sum and the mask all in the kernel;
nothing `[.., H, t]`-sized leaves it. The exact running top-k merge is a kernel of its own, a radix select
(`kernels/indexer_select.py`, driven by `model.indexer._topk_core`, whose loop the reference shares).

Blocking: a program scores a `tile_q x tile_k` tile. It loads its key tile once ([tile_k, I], masked at
the key array's end, cast to the compute dtype) and loops over the H heads: q_h [tile_q, I] x k^T
-> [tile_q, tile_k] float32, accumulated as `w_h * relu(.)` in registers. Tiles whose smallest key
position exceeds every query position of the tile (above the causal diagonal, or past a cache's
length) skip the dots and store -inf. Keys are read in place: the kernel takes the whole key array
(a sequence's keys, or a stacked cache `[..., B, Cap, I]` flattened to rows) plus an offset, so a
cache is never sliced or copied per chunk.

FP8 scoring (`quantize_e4m3`, `k_scale`, `ModelOptions.indexer_dtype="fp8"`): DeepSeek's reference indexer
scores float8 e4m3 queries and keys with one scale per 128-wide row block. Scales are positive, so
relu(sq q8 . sk k8) = sq sk relu(q8 . k8): the per-(token, head) query scale is folded into w
and the per-key scale multiplies the head sum; the dots take e4m3 operands (Hopper's FP8 MMA, twice bf16's
rate) and accumulate in float32. Keys stored in another dtype (a bf16 cache) are quantized per row as a tile
is loaded (`quantize_keys`). Such a launch is named `dsa_index_scores_fp8` (its own plan efficiency class).

Axis letters: B batch, S queries, T keys, H heads, I head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glm52_jax import kernels
from glm52_jax.kernels import fp8_dot

_INT_MAX = jnp.iinfo(jnp.int32).max
FP8 = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(FP8).max)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Kernel tile and launch parameters, and the XLA-level blocking the top-k loop uses on a GPU.

    `query_group` x `key_chunk` is the score block one kernel launch fills and the top-k merge
    consumes: large enough that a launch has thousands of programs and few merges run per query.
    4,096 queries (was 512; issue 33): a 2M whole-prompt prefill's key loop runs 8x fewer trips (per device
    345,408 -> 43,176 on 32 GPUs) with 8x fewer launches of its scoring, merge and small bookkeeping kernels;
    the merge's bytes stay what they were (each row still merges its running top-k with 8,192 candidates per
    trip, the radix select holding a row on chip), so only the per-launch costs drop. The live score block
    is 4,096 x 8,192 float32 (128 MiB) per batch row.
    """

    tile_q: int = 64
    tile_k: int = 128  # 64x128 / 4 warps / 2 stages: 435 TFLOP/s on an H200 (70% of its measured bf16 peak)
    num_warps: int = 4
    num_stages: int = 2
    query_group: int = 4096
    key_chunk: int = 8192


GPU_TILING = Tiling()
# Interpret mode (CPU): the tiles only set how finely the interpreter loops; the XLA blocking is the
# caller's (ModelOptions' indexer blocks), so small test shapes still cross several blocks.
INTERPRET_TILING = Tiling(tile_q=16, tile_k=32, query_group=0, key_chunk=0)


def tiling() -> Tiling:
    return INTERPRET_TILING if kernels.interpret() else GPU_TILING


def blocks(seq: int, num_keys: int, query_block: int, key_block: int, tiles: Tiling | None = None) -> tuple[int, int]:
    """The (query block, key block) of the top-k loop for the kernel path: at least the tiling's
    group / chunk and at most what the sequence and keys need; the key block a multiple of the key
    tile. (`index_scores` pads a query block to whole tiles itself and slices the padding off before
    the merge: a decode step merges its one query row, not a tile of 16.)"""
    t = tiling() if tiles is None else tiles
    qb = min(max(query_block, t.query_group), seq)
    kb = min(max(key_block, t.key_chunk), num_keys)
    return qb, -(-kb // t.tile_k) * t.tile_k


def _tile_q(seq: int, t: Tiling) -> int:
    """Query rows per program: the tiling's, or fewer for short chunks (decode) down to 16, the
    smallest dot Triton emits; the padding rows cost tensor-core work, not memory traffic."""
    rows = min(16, t.tile_q)
    while rows < min(seq, t.tile_q):
        rows *= 2
    return rows


def index_scores(q: jax.Array, w: jax.Array, q_pos: jax.Array, keys: jax.Array, key_pos: jax.Array,
                 start: jax.Array, num_keys: int, *, scale: float, lead: tuple = (),
                 k_scale: jax.Array | None = None, compute_dtype=None, quantize_keys: bool = False,
                 tiles: Tiling | None = None) -> jax.Array:
    """Masked index scores of a query block against `num_keys` key rows from `start`.

    q: [B,S,H,I] (cast to `compute_dtype`, default the keys' dtype), w: [B,S,H] float32, q_pos: [S]
    int32 (padding queries: -1). keys: [*L,B,T,I] read in place at `lead` (len(L) int32 scalars: a
    stacked cache's layer indices; () for a sequence's keys [B,T,I]), key_pos: [T] int32 (key t is
    visible to query s iff key_pos[t] <= q_pos[s]; rows past T are never visible).
    k_scale: [*L,B,T] float32 per-key scales (FP8 keys), read like the keys. `quantize_keys` (FP8 scoring of keys
    stored in another dtype, no k_scale): each key row is quantized to e4m3 as the kernel loads it, by
    `quantize_e4m3`'s rule, and its scale multiplies its score. With an e4m3 compute dtype (FP8 scoring) q holds
    e4m3 values (their scales folded into w) and the dots run on FP8 tensor cores. start: int32 scalar. Returns
    [B,S,num_keys] float32 scores, -inf where not visible.
    """
    t = tiling() if tiles is None else tiles
    compute_dtype = jnp.dtype(keys.dtype if compute_dtype is None else compute_dtype)
    batch, seq, heads, dim = q.shape
    total_keys = keys.shape[-2]
    if keys.ndim != 3 + len(lead):
        raise ValueError(f"index_scores: keys {keys.shape} need {keys.ndim - 3} lead indices, got {len(lead)}")
    tile_q = _tile_q(seq, t)
    sq = -(-seq // tile_q) * tile_q
    nk = -(-num_keys // t.tile_k) * t.tile_k
    if sq != seq:  # padded queries see nothing (position -1) and are sliced off below
        q = jnp.pad(q, ((0, 0), (0, sq - seq), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, sq - seq), (0, 0)))
        q_pos = jnp.pad(q_pos, (0, sq - seq), constant_values=-1)
    offsets = jnp.stack([jnp.asarray(start, jnp.int32), *(jnp.asarray(i, jnp.int32) for i in lead)])
    if quantize_keys and (k_scale is not None or compute_dtype != FP8):
        raise ValueError("index_scores: quantize_keys quantizes unscaled keys for an e4m3 compute dtype")
    scaled = k_scale is not None
    if not scaled:
        k_scale = jnp.ones((1,) * (keys.ndim - 1), jnp.float32)  # unused by the kernel
    name = "dsa_index_scores_fp8" if compute_dtype == FP8 else "dsa_index_scores"  # FP8 MMA: its own plan class
    if compute_dtype == FP8:
        fp8_dot.install()  # e4m3 dots as FP8 wgmma on sm_90a, not f16 mma.sync (kernels/fp8_dot.py)
    kernel = functools.partial(_score_kernel, heads=heads, total_keys=total_keys, tile_k=t.tile_k, scale=scale,
                               compute_dtype=compute_dtype, scaled=scaled, quantize_keys=quantize_keys)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, b: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, sq, nk), jnp.float32),
        grid=(sq // tile_q, nk // t.tile_k, batch),
        in_specs=[full(offsets.shape),
                  pl.BlockSpec((None, tile_q, heads, dim), lambda i, j, b: (b, i, 0, 0)),
                  pl.BlockSpec((None, tile_q, heads), lambda i, j, b: (b, i, 0)),
                  pl.BlockSpec((tile_q,), lambda i, j, b: (i,)),
                  full(keys.shape), full(key_pos.shape), full(k_scale.shape)],
        out_specs=pl.BlockSpec((None, tile_q, t.tile_k), lambda i, j, b: (b, i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=kernels.interpret(),
        # Each (query tile, key tile) program reads its key tile (+ per-key positions / scales), once per tile;
        # every tile does its dots (masked ones too): 2 * H * I per (query, key) pair of the padded grid.
        name=kernels.traffic_name(name, q.nbytes + w.size * 4 + batch * sq * nk * 4
                                  + (sq // tile_q) * batch * nk * (dim * keys.dtype.itemsize + 8),
                                  flops=2.0 * batch * sq * nk * heads * dim),
    )(offsets, q, w.astype(jnp.float32), q_pos.astype(jnp.int32), keys, key_pos.astype(jnp.int32), k_scale)
    return out[:, :seq, :num_keys]


def _score_kernel(offsets_ref, q_ref, w_ref, qpos_ref, keys_ref, kpos_ref, kscale_ref, out_ref, *, heads: int,
                  total_keys: int, tile_k: int, scale: float, compute_dtype, scaled: bool, quantize_keys: bool):
    """One [tile_q, tile_k] tile: q_ref [tq,H,I], w_ref [tq,H], qpos_ref [tq], keys_ref [*L,B,T,I] (whole),
    offsets_ref [1 + len(L)] (first key row of the call, lead indices)."""
    # Program ids are read here, outside the pl.when bodies (the interpreter substitutes them only at
    # the kernel's top level).
    row0 = offsets_ref[0] + pl.program_id(1) * tile_k
    batch = pl.program_id(2)
    lead = tuple(offsets_ref[1 + n] for n in range(keys_ref.ndim - 3))
    rows = row0 + jnp.arange(tile_k, dtype=jnp.int32)
    in_range = (rows >= 0) & (rows < total_keys)
    kpos = pltriton.load(kpos_ref.at[pl.ds(row0, tile_k)], mask=in_range, other=_INT_MAX)
    qpos = qpos_ref[...]
    visible = kpos[None, :] <= qpos[:, None]
    tile_shape = visible.shape

    @pl.when(jnp.min(kpos) <= jnp.max(qpos))
    def _score():
        dim = keys_ref.shape[-1]
        # Rows past the key array are masked off the load (no `other`: Triton cannot splat an integer
        # fill into float8 lanes); their undefined values only reach columns the mask below hides.
        k = pltriton.load(keys_ref.at[(*lead, batch, pl.ds(row0, tile_k), slice(None))],
                          mask=jnp.broadcast_to(in_range[:, None], (tile_k, dim)))
        if quantize_keys:  # quantize_e4m3 of each row, as loaded (masked rows: any finite scale, never shown)
            k = k.astype(jnp.float32)
            amax = jnp.max(jnp.abs(k), axis=1)
            row_scale = jnp.where(amax > 0, amax * jnp.float32(1.0 / _FP8_MAX), 1.0)
            k = k * (1.0 / row_scale)[:, None]
        k = k.astype(compute_dtype)
        precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

        def head(h, acc):
            q_h = q_ref[:, h, :].astype(compute_dtype)  # [tq, I]
            logits = jax.lax.dot_general(q_h, k, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)  # [tq, tk]
            return acc + w_ref[:, h][:, None] * jnp.maximum(logits * scale, 0.0)

        # +0.0 start, as XLA's dot accumulators: a score whose terms are all -0.0 (negative weights,
        # relu 0) is +0.0, not -0.0 (the top-k's total order ranks -0.0 below +0.0, so zero-score ties
        # would otherwise order differently from the reference).
        acc = jax.lax.fori_loop(0, heads, head, jnp.zeros(tile_shape, jnp.float32))
        if scaled:
            k_scale = pltriton.load(kscale_ref.at[(*lead, batch, pl.ds(row0, tile_k))], mask=in_range, other=1.0)
            acc = acc * k_scale[None, :]
        elif quantize_keys:
            acc = acc * row_scale[None, :]
        out_ref[...] = jnp.where(visible, acc, -jnp.inf)

    @pl.when(jnp.min(kpos) > jnp.max(qpos))
    def _skip():
        out_ref[...] = jnp.full(tile_shape, -jnp.inf, jnp.float32)


def quantize_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row (last axis, one 128-wide block at the indexer's head dim) float8 e4m3 quantisation:
    `x: [..., I] -> (x8 [..., I] float8_e4m3fn, scale [...] float32)` with x ~= x8 * scale.

    scale = amax|row| / 448 (1 for an all-zero row), x8 = e4m3(row / scale), both divisions written as the
    products XLA compiles them to anyway (by the float32 reciprocals of 448 and of each row's scale), so every
    backend rounds the same way and an oracle can repeat it exactly."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax > 0, amax * jnp.float32(1.0 / _FP8_MAX), 1.0)
    return (x.astype(jnp.float32) * (1.0 / scale)[..., None]).astype(FP8), scale
