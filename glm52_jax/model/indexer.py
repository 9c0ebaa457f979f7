"""DSA lightning indexer and its streaming exact top-k.

Score of key s for query t (HF `GlmMoeDsaIndexer`):
    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * index_head_dim**-0.5),  w = weights_proj(x) * H**-0.5
over causal keys (pos[s] <= pos[t]); each query keeps the top `index_topk` keys.

Scalable path: queries are processed in blocks (`lax.map`), and for each block the keys stream
through in blocks (a `fori_loop` that stops at the last causally visible block) while a running
top-k is merged with each new block's scores. No
`[S, T]` array exists; live memory is `O(query_block * (topk + key_block))`.

Kernel path (`kernels="pallas"`, or "auto" on a GPU; glm52_jax.kernels): the same loop, with each
block scored by the fused Pallas kernel (kernels/indexer.py: dots, relu, weighted head sum and causal
mask in one kernel; keys read in place) and merged by radix select (kernels/indexer_select.py: linear
in the candidates, one sort per query at the end) instead of `lax.top_k`; on a GPU its blocks are
larger (a 512-query group x 8192-key chunk per step). Same top-k, ties included (tests/kernels).

FP8 scoring (`indexer_dtype="fp8"`, `ModelOptions.indexer_dtype`): queries are quantized per (token, head) row and
keys per row to e4m3 with one float32 scale each (`kernels.indexer.quantize_e4m3`, the FP8 cache's rule; an FP8
cache's keys are read as stored). Scales are positive, so

    w[t,h] relu(sq[t,h] sk[s] q8 . k8 * c) = (w[t,h] sq[t,h]) relu(q8 . k8 * c) sk[s]:

the query scales fold into w, the e4m3 dots run on FP8 tensor cores (exact products, float32 accumulation) and each
key's scale multiplies its head sum. The reference computes the same formula on the e4m3 values held in float32,
so both paths select the same top-k of the quantized scores; what FP8 changes is which keys a query selects where
bf16 scores nearly tie (overlap measured in benchmarks/indexer_fp8.py).

Before FP8 quantization, q and k are rotated by the orthonormal Hadamard matrix of the head dim (`hadamard`,
`Indexer.project(rotate=True)`), as DeepSeek-V3.2's reference indexer does (`rotate_activation` before `act_quant`):
(q H) . (k H) = q . k, so the scores are unchanged in exact arithmetic, but an outlier channel is spread over all
128, so one row's scale no longer crushes its other entries to a few e4m3 steps. The rotated keys are what the
cache holds (bf16 or e4m3), and the rotated values are rounded to the parameter dtype as the unrotated ones were,
so a whole-sequence call and a chunked one over the cache quantize the same numbers. bf16 scoring never rotates
(HF's indexer does not; there it would only add rounding), nor does FP8 with rescored candidates (below): rounding
the rotated values to bf16 perturbs the scores as much as bf16 itself does (benchmarks/indexer_fp8.py: rescoring
rotated values kept 0.998 of bf16's top-2048 at 64K keys, 1.0 unrotated), and the rescoring must score bf16's values.

FP8 candidates rescored (`candidates` M > 0, `ModelOptions.indexer_candidates`): the FP8 key loop keeps each query's
best M (> K) keys instead of K, and those M are scored again from the unquantized q, w and keys (a gather of M key
rows per query, in the parameter dtype with float32 accumulation: bf16 scoring's formula), and the top K of those
scores is the selection, ties to the lower key index as bf16's merge. Whenever bf16's top K lie within FP8's top M,
this is bf16 scoring's selection (up to the float32 summation order of equal-looking scores), at FP8's price for the
O(S x T) part: the rescoring is O(S x M), and the merge carries M candidates (benchmarks/indexer_fp8.py measures
how far down FP8's ranking bf16's top K reach).

Axis letters: B batch, S queries, T keys, H indexer heads, I indexer head dim, K top-k, D model dim,
Q q_lora rank, R rotary dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax import positions as rope_lib
from glm52_jax.choices import INDEXER_DTYPES
from glm52_jax.config import ModelConfig
from glm52_jax.kernels import indexer as kernel_indexer
from glm52_jax.kernels import indexer_select as kernel_select
from glm52_jax.kernels import use_pallas
from glm52_jax.model import cache_fp8
from glm52_jax.model.layers import LayerNorm, param, project
from glm52_jax.model.loop_scopes import CACHED_KEY_LOOP, CAUSAL_KEY_LOOP
from glm52_jax.parallel.rules import constrain

INVALID = -1  # top-k slot with no causal key (rows with fewer than K predecessors)


class Indexer(nnx.Module):
    """Projections of one 'full' layer's indexer; `weights_proj` is kept in float32."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = param(rngs, (cfg.q_lora_rank, self.n_heads, self.head_dim), ("q_lora", "index_heads", "index_dim"),
                          dtype)
        self.wk = param(rngs, (cfg.hidden_size, self.head_dim), ("embed", "index_dim"), dtype)
        self.k_norm = LayerNorm(self.head_dim, 1e-6, "index_dim", dtype)
        self.weights_proj = param(rngs, (cfg.hidden_size, self.n_heads), ("embed", "index_heads"), jnp.float32)

    def project(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array, rotate: bool = False):
        """`x: [B,S,D], q_resid: [B,S,Q] -> q: [B,S,H,I], k: [B,S,I], w: [B,S,H]` (float32).

        `w` already includes `H**-0.5`; `q . k` still needs `head_dim**-0.5` (see `topk`). `rotate`: q and k
        after RoPE times the Hadamard matrix (`hadamard`; FP8 scoring, module docstring), rounded to the dtype
        they had.
        """
        q = project(q_resid, self.wq_b, "bsq,qhi->bshi")
        q_rot = rope_lib.apply_interleaved_rope(q[..., : self.rope_dim], cos[:, :, None, :], sin[:, :, None, :])
        q = jnp.concatenate([q_rot, q[..., self.rope_dim:]], axis=-1)
        k = self.k_norm(project(x, self.wk, "bsd,di->bsi"))
        k_rot = rope_lib.apply_interleaved_rope(k[..., : self.rope_dim], cos, sin)
        k = jnp.concatenate([k_rot, k[..., self.rope_dim:]], axis=-1)
        if rotate:
            q, k = rotate_rows(q), rotate_rows(k)
        w = project(x, self.weights_proj, "bsd,dh->bsh") * (self.n_heads ** -0.5)  # float32 (the kernel's dtype)
        q = constrain(q.astype(jnp.float32), ("batch", "seq", "index_heads", "index_dim"))
        return q, k.astype(jnp.float32), w


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Hadamard matrix of order n (a power of 2), Sylvester's order (H_2m = [[H, H], [H, -H]] /
    sqrt 2, the order of DeepSeek's `hadamard_transform`): symmetric, H @ H = I, every entry +-n**-0.5."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: the order must be a power of 2, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotate_rows(x: jax.Array) -> jax.Array:
    """`x [..., I] -> x @ hadamard(I)` in float32, rounded back to x's dtype (what FP8 scoring quantizes)."""
    rotation = jnp.asarray(hadamard(x.shape[-1]), jnp.float32)
    rotated = jnp.einsum("...i,ij->...j", x.astype(jnp.float32), rotation, precision=jax.lax.Precision.HIGHEST)
    return rotated.astype(x.dtype)


def _pad_to(x: jax.Array, axis: int, multiple: int, value) -> jax.Array:
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def causal_blocks(seq: int, num_keys: int, query_block: int, key_block: int, kernels: str) -> tuple[int, int]:
    """(query block, key block) of `streaming_topk`'s loops for `seq` queries over `num_keys` keys: the options'
    blocks (the Pallas path's at least its tiling's group / chunk), at most what the sequence needs. Plan mode's
    trip counts (plan/loop_trips.py) use the same rule."""
    if use_pallas(kernels):
        return kernel_indexer.blocks(seq, num_keys, query_block, key_block)
    return min(query_block, seq), min(key_block, num_keys)


def cached_blocks(queries: int, capacity: int, query_block: int, key_block: int, kernels: str) -> tuple[int, int]:
    """(query block, key block) of `cached_topk` for `queries` queries over a cache of `capacity` slots. Few
    queries (decode) take proportionally longer key blocks: the live score block stays query_block x key_block
    while the loop runs fewer, larger steps."""
    wide = key_block * max(1, query_block // queries)
    if use_pallas(kernels):
        return kernel_indexer.blocks(queries, capacity, query_block, wide)
    return min(query_block, queries), min(wide, capacity)


def block_scores(q: jax.Array, w: jax.Array, k: jax.Array, scale: float, k_scale: jax.Array | None = None) -> jax.Array:
    """Index scores of a query block against a key block: `[B,s,H,I], [B,s,H], [B,t,I] -> [B,s,t]`; `k_scale`
    [B,t]: the keys' per-row scales (e4m3 keys), multiplying each key's head sum."""
    logits = jnp.einsum("bshi,bti->bsht", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.einsum("bsh,bsht->bst", w, jax.nn.relu(logits))
    return scores if k_scale is None else scores * k_scale[:, None, :]


def check_indexer_dtype(indexer_dtype: str) -> bool:
    """Whether `indexer_dtype` (`choices.INDEXER_DTYPES`) scores in FP8."""
    if indexer_dtype not in INDEXER_DTYPES:
        raise ValueError(f"indexer_dtype: expected one of {INDEXER_DTYPES}, got {indexer_dtype!r}")
    return indexer_dtype == "fp8"


def rotates(indexer_dtype: str, candidates: int) -> bool:
    """Whether the indexer's q and k are Hadamard-rotated (`Indexer.project(rotate=...)`): FP8's own selection only,
    not bf16 scoring nor rescored FP8 candidates (module docstring)."""
    return check_indexer_dtype(indexer_dtype) and not candidates


def fp8_settings_problem(index_head_dim: int, index_topk: int, indexer_dtype: str, candidates: int) -> str | None:
    """What keeps FP8 scoring's settings from running on an architecture (one line naming the fix), or None."""
    if check_indexer_dtype(indexer_dtype) and 0 < candidates <= index_topk:
        return (f"indexer_candidates={candidates} rescores nothing: it must exceed the model's index_topk "
                f"({index_topk}), or be 0 for FP8's own top-k")
    if rotates(indexer_dtype, candidates) and index_head_dim & (index_head_dim - 1):
        return (f"indexer_dtype=fp8 rotates the indexer's q and k by a Hadamard matrix, which needs index_head_dim a "
                f"power of 2 (the model's: {index_head_dim}); use indexer_dtype=bf16")
    return None


def quantize_queries(q: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8 scoring's queries: `q [B,S,H,I], w [B,S,H] -> (e4m3 values of q held in float32 [B,S,H,I], w x the
    per-(token, head) scales [B,S,H])` (module docstring: a positive scale moves through relu into w)."""
    q8, q_scale = kernel_indexer.quantize_e4m3(jax.lax.stop_gradient(q))
    return q8.astype(jnp.float32), jax.lax.stop_gradient(w) * q_scale


def streaming_topk(q: jax.Array, w: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, topk: int, *,
                   scale: float, query_block: int, key_block: int, sorted_keys: bool = True,
                   return_scores: bool = False, kernels: str = "reference", score_dtype=None,
                   loop_name: str = CAUSAL_KEY_LOOP, indexer_dtype: str = "bf16", candidates: int = 0):
    """Exact causal top-k of the index scores without materialising `[S, T]`.

    q: [B,S,H,I], w: [B,S,H], k: [B,T,I], q_pos: [S], k_pos: [T] (key s is visible to query t
    iff k_pos[s] <= q_pos[t]). Returns [B,S,K] int32 key indices, K = min(topk, T), ordered by
    descending score; slots without a visible key hold INVALID. `sorted_keys` (k_pos ascending,
    as in a sequence or a cache) lets each query block stop at its last visible key block.
    With `return_scores`, returns (scores [B,S,K] float32, -inf where INVALID, indices).
    `kernels` (ModelOptions.kernels) selects the scoring: this module's jnp blocks or the fused
    Pallas kernel (glm52_jax.kernels.indexer), which scores in `score_dtype` (default: k's dtype;
    the model passes its parameter dtype: its q and k are values of that dtype held in float32,
    so the cast is exact). Same top-k either way (the merge below is shared). `loop_name`: the key loop's
    name scope (`loop_scopes`), which tells plan mode's estimate which trip count it has. `indexer_dtype`:
    "bf16" (the above) or "fp8" (module docstring: q and k quantized to e4m3 once per call, FP8 MMA in the kernel).
    `candidates`: with "fp8", M > 0 keeps FP8's best M keys per query and selects the top K of them rescored
    unquantized (module docstring).
    """
    batch, seq = q.shape[:2]
    num_keys = k.shape[1]
    k, k_pos = jax.lax.stop_gradient(k), k_pos.astype(jnp.int32)
    qb, kb = causal_blocks(seq, num_keys, query_block, key_block, kernels)
    fp8 = check_indexer_dtype(indexer_dtype)
    kk = min(topk, num_keys)
    # Unquantized: what the FP8 candidates are rescored against, held in the scoring dtype (the keys are its values
    # in float32), so each rescoring gathers half the bytes of float32 rows and casts nothing.
    exact_keys = k if score_dtype is None else k.astype(score_dtype)

    def key_rows(idx):
        return _take_rows(exact_keys, idx)

    rescore = _rescoring(fp8, candidates, topk, num_keys, q, w, _gathered_scores(key_rows, scale, score_dtype))
    k_scale = None
    if fp8:
        q, w = quantize_queries(q, w)
        k, k_scale = kernel_indexer.quantize_e4m3(k)  # [B,T,I] e4m3, [B,T]
    if use_pallas(kernels):
        dtype = kernel_indexer.FP8 if fp8 else (k.dtype if score_dtype is None else score_dtype)
        keys = k.astype(dtype)  # once per call; the kernel reads key rows in place from it
        q = q.astype(dtype)  # once per call too, not per key-loop trip (XLA left the cast in the loop body)

        def score_block(j, q_blk, w_blk, qpos_blk):
            scores = kernel_indexer.index_scores(q_blk, w_blk, qpos_blk, keys, k_pos, j * kb, kb,
                                                 scale=scale, k_scale=k_scale)
            return scores, j * kb + jnp.arange(kb, dtype=jnp.int32)
    else:
        nk = -(-num_keys // kb)
        k_rows = k.astype(jnp.float32) if fp8 else k  # e4m3 values held in float32 (exact)
        k_blocks = _pad_to(k_rows, 1, kb, 0.0).reshape(batch, nk, kb, -1).swapaxes(0, 1)  # [nk, B, kb, I]
        kpos_blocks = _pad_to(k_pos, 0, kb, jnp.iinfo(jnp.int32).max).reshape(nk, kb)  # padding: never visible
        s_blocks = None if k_scale is None else _pad_to(k_scale, 1, kb, 1.0).reshape(batch, nk, kb).swapaxes(0, 1)

        def read(j):
            return (k_blocks[j], kpos_blocks[j], j * kb + jnp.arange(kb, dtype=jnp.int32),
                    None if s_blocks is None else s_blocks[j])

        score_block = _reference_scores(read, scale)

    # Key blocks whose smallest position exceeds a query block's largest one hold nothing visible;
    # with positions sorted (slot order) the visible blocks are a prefix, so the loop stops there.
    nk = -(-num_keys // kb)
    kpos_first = k_pos[::kb]

    def visible_blocks(qpos_blk):
        if sorted_keys:
            return jnp.sum(kpos_first <= jnp.max(qpos_blk)).astype(jnp.int32)
        return nk

    keep = kk if rescore is None else rescore[0]
    merger = _SelectMerge(keep) if use_pallas(kernels) else None
    return _topk_core(q, w, q_pos, score_block, visible_blocks, qb, keep, return_scores, merger, loop_name, rescore)


def cached_topk(q: jax.Array, w: jax.Array, keys: jax.Array, index: tuple, q_pos: jax.Array, length: jax.Array,
                topk: int, *, scale: float, query_block: int, key_block: int, kernels: str = "reference",
                score_dtype=None, key_scales: jax.Array | None = None, indexer_dtype: str = "bf16",
                candidates: int = 0):
    """Top-k over cache slots `[0, length)` of `keys[index]` (every query sits at or after `length`).

    keys: [..., B, Cap, I] a stacked cache read in place: the reference reads each key block as a
    small dynamic slice at `index + (0, block_start, 0)`, the Pallas kernel (`kernels`, see
    `streaming_topk`) reads the rows straight from the stack; no per-layer copy of the cache is
    made. key_scales: [..., B, Cap] per-row scales of e4m3 keys (an FP8 cache, `model/cache_fp8.py`), or
    None: the reference dequantizes each key block it reads, the kernel casts the e4m3 keys it loads to
    `score_dtype` (exact) and multiplies each key's score by its scale (relu commutes with a positive scale).
    `indexer_dtype="fp8"` (module docstring): the queries are quantized, e4m3 keys with scales are scored as stored
    on FP8 tensor cores, keys of another dtype are quantized per row as each block is read (the kernel: as it loads
    them; never the whole cache). `candidates`: as `streaming_topk`'s (the rescoring gathers the M candidates' rows
    from the stack, dequantized where it is e4m3).
    Returns (scores [B,S,K], indices [B,S,K]) with K = min(topk, Cap), INVALID / -inf where empty.
    """
    batch, capacity, dim = keys.shape[-3:]
    lead = tuple(jnp.asarray(i, jnp.int32) for i in index)
    kk = min(topk, capacity)
    qb, kb = cached_blocks(q.shape[1], capacity, query_block, key_block, kernels)
    if key_scales is not None:
        key_scales = jax.lax.stop_gradient(key_scales)
    fp8 = check_indexer_dtype(indexer_dtype)

    rows_dtype = jnp.float32 if score_dtype is None else score_dtype

    def stack_rows(idx):  # [B,r,M] slots -> their key rows [B,r,M,I] in the scoring dtype (e4m3 rows dequantized)
        rows = _take_rows(jax.lax.stop_gradient(keys[lead]), idx)
        if key_scales is None:
            return rows.astype(rows_dtype)
        return cache_fp8.read_rows(rows, _take_rows(key_scales[lead][..., None], idx)[..., 0], rows_dtype)

    rescore = _rescoring(fp8, candidates, topk, capacity, q, w, _gathered_scores(stack_rows, scale, score_dtype))
    keep = kk if rescore is None else rescore[0]
    if fp8:
        q, w = quantize_queries(q, w)
    if use_pallas(kernels):
        # bf16 scoring never quantizes the queries: e4m3 keys score against queries in `score_dtype` (float32
        # without one). FP8 scoring quantizes a non-e4m3 cache's key rows in the kernel as it loads them.
        if fp8:
            dtype = kernel_indexer.FP8
        else:
            dtype = (keys.dtype if key_scales is None else jnp.float32) if score_dtype is None else score_dtype
        quantize_keys = fp8 and key_scales is None
        q = q.astype(dtype)  # once per call, not per key-loop trip
        slots = jnp.arange(capacity, dtype=jnp.int32)
        slot_pos = jnp.where(slots < length, slots, jnp.iinfo(jnp.int32).max)  # unwritten slots: never visible

        def score_block(j, q_blk, w_blk, qpos_blk):
            scores = kernel_indexer.index_scores(q_blk, w_blk, qpos_blk, jax.lax.stop_gradient(keys),
                                                 slot_pos, j * kb, kb, scale=scale, lead=lead, compute_dtype=dtype,
                                                 k_scale=key_scales, quantize_keys=quantize_keys)
            return scores, j * kb + jnp.arange(kb, dtype=jnp.int32)

        return _topk_core(q, w, q_pos, score_block, lambda qpos_blk: (length + kb - 1) // kb, qb, keep, True,
                          _SelectMerge(keep), CACHED_KEY_LOOP, rescore)
    zero = jnp.zeros((), jnp.int32)

    def read(j):
        # Blocks of kb slots from j*kb; when kb does not divide the capacity the last block is
        # moved back to end at the capacity (a slice must stay inside the array) and the slots
        # an earlier block already scored are masked out. (Earlier the block was the gcd of the
        # capacity and kb: 1 slot for a capacity like 8207, and a 100x slower loop.)
        first = j * kb
        start_slot = jnp.minimum(first, capacity - kb)
        blk = jax.lax.dynamic_slice(keys, (*lead, zero, start_slot, zero), (1,) * len(lead) + (batch, kb, dim))
        slots = start_slot + jnp.arange(kb, dtype=jnp.int32)
        kpos = jnp.where((slots >= first) & (slots < length), slots, jnp.iinfo(jnp.int32).max)
        blk = jax.lax.stop_gradient(blk.reshape(batch, kb, dim))
        blk_scale = None
        if key_scales is not None:
            blk_scale = jax.lax.dynamic_slice(key_scales, (*lead, zero, start_slot), (1,) * len(lead) + (batch, kb))
            blk_scale = blk_scale.reshape(batch, kb)
        if fp8:  # e4m3 rows and their scales, as stored or quantized here (this block only)
            if blk_scale is None:
                blk, blk_scale = kernel_indexer.quantize_e4m3(blk)
            return blk.astype(jnp.float32), kpos, slots, blk_scale
        if blk_scale is None:
            return blk.astype(jnp.float32), kpos, slots, None
        # An FP8 cache scored in bf16: this block's rows dequantized with their scales (never the whole stack).
        return cache_fp8.read_rows(blk, blk_scale, jnp.float32), kpos, slots, None

    return _topk_core(q, w, q_pos, _reference_scores(read, scale), lambda qpos_blk: (length + kb - 1) // kb,
                      qb, keep, True, None, CACHED_KEY_LOOP, rescore)


def merge_topk(first: tuple[jax.Array, jax.Array], second: tuple[jax.Array, jax.Array], topk: int,
               ties: str = "first") -> jax.Array:
    """Top-k of two scored candidate lists `(scores, indices) [B,S,*]`, best first. Equal scores keep `first`'s
    entries, in list order (`ties="first"`: one device, where that is the lower slot), or the lower slot
    (`ties="slot"`: candidates gathered from strided slot shards, whose concatenation is not in slot order);
    either way the one-device streaming top-k's choice and order."""
    vals = jnp.concatenate([first[0], second[0]], axis=-1)
    idxs = jnp.concatenate([first[1], second[1]], axis=-1)
    k = min(topk, vals.shape[-1])
    if ties == "slot":
        # lax.sort compares floats as numbers (-0.0 == +0.0), lax.top_k in its total order (-0.0 below +0.0, which
        # relu-weighted scores produce): sort on the bits' order instead, descending (~), then by slot.
        bits = jax.lax.bitcast_convert_type(vals, jnp.int32)
        order = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # int order = float total order
        _, picked, best = jax.lax.sort((~order, idxs, vals), dimension=-1, num_keys=2)
        best, picked = best[..., :k], picked[..., :k]
    else:
        best, pos = jax.lax.top_k(vals, k)
        picked = jnp.take_along_axis(idxs, pos, axis=-1)
    return jnp.where(jnp.isneginf(best), INVALID, picked)


# Queries whose M candidates one rescoring step gathers at once: [r, M, I] rows (r x 4,096 x 128 x 4 B = 512 MiB
# at r = 256) and [r, H, M] float32 logits, whatever the key loop's query block (4,096 on a GPU).
RESCORE_ROWS = 256


def _take_rows(rows: jax.Array, idx: jax.Array) -> jax.Array:
    """`rows [B,T,I]`, `idx [B,r,M]` (INVALID allowed) -> `[B,r,M,I]` (row 0 where INVALID)."""
    return jax.vmap(lambda r, i: r[i])(rows, jnp.maximum(idx, 0))


def _gathered_scores(take, scale: float, score_dtype):
    """score_candidates(q [B,r,H,I], w [B,r,H], idx [B,r,M]) -> [B,r,M] float32: `block_scores`' formula on the
    candidates' key rows `take(idx)`, in `score_dtype` (float32 without one) with float32 accumulation."""
    dtype = jnp.float32 if score_dtype is None else score_dtype

    def score(q, w, idx):
        rows = take(idx)
        logits = jnp.einsum("brhi,brmi->brhm", q.astype(dtype), rows.astype(dtype),
                            preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST) * scale
        return jnp.einsum("brh,brhm->brm", w, jax.nn.relu(logits), precision=jax.lax.Precision.HIGHEST)

    return score


def _rescoring(fp8: bool, candidates: int, topk: int, num_keys: int, q, w, score_candidates):
    """`_topk_core`'s `rescore` argument: (M, K, unquantized (q, w), score_candidates), or None (plain selection:
    bf16 scoring or no `candidates`). Rescored also where no more than K keys exist (M = K): the scores returned
    are then the unquantized ones, as callers merging candidates from several key sets (a cache and the chunk,
    slot shards of several devices) need them all on one scale."""
    if candidates < 0:
        raise ValueError(f"indexer candidates: expected 0 (off) or more than the top-k, got {candidates}")
    if not (fp8 and candidates):
        return None
    if candidates <= topk:
        raise ValueError(f"indexer candidates: {candidates} must exceed the top-k ({topk}) to rescore anything")
    return min(candidates, num_keys), min(topk, num_keys), jax.lax.stop_gradient((q, w)), score_candidates


def _rescored(idx, q, w, score_candidates, kk: int):
    """FP8's candidates `idx [B,r,M]` (INVALID where none) -> (scores, indices) [B,r,K] of the best K by
    `score_candidates` (the unquantized scores), best first; equal scores keep the lower key index, as the
    bf16 merge does (`lax.top_k` keeps the first of equals, and the candidates are put in key order first)."""
    idx = jnp.sort(idx, axis=-1)
    rows = idx.shape[1]
    sub = max(d for d in range(1, min(rows, RESCORE_ROWS) + 1) if rows % d == 0)

    def one(args):
        q_s, w_s, i_s = args
        return jnp.where(i_s >= 0, score_candidates(q_s, w_s, i_s), -jnp.inf)

    if sub == rows:
        scores = one((q, w, idx))
    else:
        def split(a):
            return a.reshape(a.shape[0], rows // sub, sub, *a.shape[2:]).swapaxes(0, 1)

        scores = jax.lax.map(one, (split(q), split(w), split(idx)))  # [n, B, sub, M]
        scores = scores.swapaxes(0, 1).reshape(idx.shape)
    best, pos = jax.lax.top_k(scores, kk)
    picked = jnp.take_along_axis(idx, pos, axis=-1)
    return best, jnp.where(jnp.isneginf(best), INVALID, picked)


def _reference_scores(read_block, scale):
    """The jnp scoring of key block j: read_block(j) -> (keys [B,kb,I] float32, key positions [kb], key
    indices [kb], the keys' scales [B,kb] or None); returns score_block(j, q_blk, w_blk, qpos_blk) -> (masked scores
    [B,qb,kb], indices)."""

    def score_block(j, q_blk, w_blk, qpos_blk):
        k_blk, kpos, kidx, k_scale = read_block(j)
        scores = block_scores(q_blk, w_blk, k_blk, scale, k_scale)
        visible = kpos[None, None, :] <= qpos_blk[None, :, None]
        return jnp.where(visible, scores, -jnp.inf), kidx

    return score_block


class _SortMerge:
    """The reference's running top-k: kept sorted, merged with each block by `lax.top_k`."""

    def __init__(self, kk: int):
        self.kk = kk

    def init(self, batch: int, rows: int):
        return (jnp.full((batch, rows, self.kk), -jnp.inf, jnp.float32),
                jnp.full((batch, rows, self.kk), INVALID, jnp.int32))

    def step(self, carry, scores, kidx):
        best_val, best_idx = carry  # [B,qb,K]
        # Running entries come first and hold smaller key indices, so ties keep the lowest index.
        vals = jnp.concatenate([best_val, scores], axis=-1)
        idxs = jnp.concatenate([best_idx, jnp.broadcast_to(kidx, scores.shape)], axis=-1)
        new_val, pos = jax.lax.top_k(vals, self.kk)
        return new_val, jnp.take_along_axis(idxs, pos, axis=-1)

    def finish(self, carry):
        best_val, best_idx = carry
        return best_val, jnp.where(jnp.isneginf(best_val), INVALID, best_idx)


class _SelectMerge:
    """The kernel path's running top-k: radix-selected per block (kernels/indexer_select.py: linear in
    the candidates, no sort), sorted once at the end; same result as `_SortMerge`."""

    def __init__(self, kk: int):
        self.kk, self.keep = kk, kernel_select.next_pow2(kk)

    def init(self, batch: int, rows: int):
        return kernel_select.init_running(batch, rows, self.keep)

    def step(self, carry, scores, kidx):
        return kernel_select.merge_select(carry, scores, kidx[0])  # block indices are kidx[0] + arange

    def finish(self, carry):
        return kernel_select.finish(carry, self.kk)


def _topk_core(q, w, q_pos, score_block, visible_blocks, qb, kk, return_scores, merger=None,
               loop_name=CAUSAL_KEY_LOOP, rescore=None):
    """Query blocks of qb (`lax.map`) x visible key blocks (`fori_loop`) with a running top-k.

    score_block(j, q_blk [B,qb,H,I], w_blk [B,qb,H], qpos_blk [qb]) -> (scores [B,qb,kb] float32,
    -inf where not visible; key indices [kb], consecutive and increasing with j); visible_blocks(qpos_blk)
    -> number of leading key blocks any query of the block can see. `merger`: `_SortMerge` (default)
    or `_SelectMerge`. `loop_name`: the key loop's name scope (CAUSAL_KEY_LOOP / CACHED_KEY_LOOP).
    `rescore`: None, or (M = kk, K, (q, w) unquantized, score_candidates) from `_rescoring`: the loop keeps M
    candidates and each query block returns the best K of them by `score_candidates` (`_rescored`).
    """
    merger = _SortMerge(kk) if merger is None else merger
    # No gradient flows through selection (HF runs the indexer under no_grad); stopping it at the
    # inputs also lets the key loop below have a data-dependent trip count.
    q, w = jax.lax.stop_gradient((q, w))
    batch, seq, _, _ = q.shape
    q = _pad_to(q, 1, qb, 0.0)
    w = _pad_to(w, 1, qb, 0.0)
    q_pos_p = _pad_to(q_pos, 0, qb, -1)  # padded queries see no key
    nq = q.shape[1] // qb
    out_k = kk if rescore is None else rescore[1]

    def one_query_block(args):
        q_blk, w_blk, qpos_blk = args[:3]  # [B,qb,H,I], [B,qb,H], [qb]

        def merge(j, carry):
            return merger.step(carry, *score_block(j, q_blk, w_blk, qpos_blk))

        with jax.named_scope(loop_name):
            carry = jax.lax.fori_loop(0, visible_blocks(qpos_blk), merge, merger.init(batch, qb))
        vals, idx = merger.finish(carry)
        if rescore is None:
            return vals, idx
        return _rescored(idx, *args[3:], rescore[3], out_k)

    def blocks(a):  # [B, nq*qb, ...] -> [nq, B, qb, ...]
        return _pad_to(a, 1, qb, 0.0).reshape(batch, nq, qb, *a.shape[2:]).swapaxes(0, 1)

    xs = (blocks(q), blocks(w), q_pos_p.reshape(nq, qb))
    if rescore is not None:
        xs += tuple(blocks(a) for a in rescore[2])
    vals, idx = jax.lax.map(one_query_block, xs)  # [nq,B,qb,K]

    def unblock(x):
        return x.swapaxes(0, 1).reshape(batch, nq * qb, out_k)[:, :seq]

    return (unblock(vals), unblock(idx)) if return_scores else unblock(idx)
