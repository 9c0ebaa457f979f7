"""Exact top-k merge by radix select (Pallas, Triton backend): the kernel path's replacement for
`lax.top_k` over `[running top-k | new key block]` in the streaming indexer.

`lax.top_k` with k = 2048 sorts every candidate row (XLA lowers large-k top-k to a sort): on an H200 that
sort, not the scoring, took ~90% of a 32K-token top-k. Selection needs no order, so each merge here is
linear in the candidates and the one sort by score happens once per query, over its final k entries.

Order used everywhere (the reference's): higher score first, and among equal scores the lower key
index first. Scores map to uint32 keys whose unsigned order is the float order with -0.0 below +0.0
(`lax.top_k`'s total order). Per row, the kernel
  1. finds the `keep`-th largest key t bit by bit from the top (32 counting passes over the row, the
     row held in registers): t = max{v : #(key >= v) >= keep};
  2. selects every key > t and, of the keys == t, the first `keep - #(key > t)` in candidate order;
  3. writes the selected entries compacted, in candidate order, to slots 0..keep-1 (a scatter; the
     unselected lanes write to a spare slot `keep` that is never read).
Candidate order is the running entries, then the block's: the running set is kept in increasing key
index (it is written in candidate order, and every block's indices exceed the earlier blocks'), so
"first in candidate order" is "lowest key index", the reference's tie rule. Running slots start as
-inf / INVALID placeholders; -inf entries become INVALID at the end, as in the reference.

`keep` and the block width are powers of two (Triton's ranges); `merge_select` pads the block with
-inf and the caller keeps `keep = next_pow2(K)` entries (a superset of the top-K whose sorted prefix
is the top-K).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glm52_jax import kernels

INVALID = -1


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def init_running(batch: int, rows: int, keep: int) -> tuple[jax.Array, jax.Array]:
    """Empty running sets `[B, rows, keep + 1]` (the last slot is the kernel's spare)."""
    return (jnp.full((batch, rows, keep + 1), -jnp.inf, jnp.float32),
            jnp.full((batch, rows, keep + 1), INVALID, jnp.int32))


def merge_select(running: tuple[jax.Array, jax.Array], scores: jax.Array, first_index: jax.Array,
                 rows_per_program: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-`keep` of running `(values, indices) [B,R,keep+1]` and a block's `scores [B,R,N]` (key
    index of column n: first_index + n); returns the new running set, in increasing key index."""
    values, indices = running
    batch, rows, width = values.shape
    keep = width - 1
    if keep != next_pow2(keep):
        raise ValueError(f"merge_select: keep={keep} is not a power of two")
    block = scores.shape[-1]
    padded = next_pow2(block)
    if padded != block:  # -inf columns are never preferred to a real entry (ties go to the lower index)
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, padded - block)), constant_values=-jnp.inf)
    # One row per GPU program (its candidates live in registers); the interpreter runs programs one
    # after another, so there several rows share one (a ragged last block is padded by the interpreter).
    rpp = min(rows_per_program or (16 if kernels.interpret() else 1), next_pow2(rows))
    if rows % rpp and not kernels.interpret():
        raise ValueError(f"merge_select: {rows} rows are not a multiple of {rpp} rows per program")
    kernel = functools.partial(_select_kernel, keep=keep)
    row_spec = lambda n: pl.BlockSpec((None, rpp, n), lambda b, r: (b, r, 0))  # noqa: E731
    out_shape = (jax.ShapeDtypeStruct(values.shape, jnp.float32), jax.ShapeDtypeStruct(indices.shape, jnp.int32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch, pl.cdiv(rows, rpp)),
        in_specs=[pl.BlockSpec((1,), lambda b, r: (0,)), row_spec(width), row_spec(width), row_spec(padded)],
        out_specs=(row_spec(width), row_spec(width)),
        # The new running set is written over the old one (a program loads its rows whole, and its stores wait for
        # the threshold, a reduction over every loaded entry): in the key loop the carry then stays in place, where
        # a fresh output was copied back into it every trip (2 x 67 MB per 4,096-query block on the 2M prefill).
        input_output_aliases={1: 0, 2: 1},
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=kernels.interpret(),
        name="dsa_topk_select",
    )(jnp.reshape(first_index, (1,)).astype(jnp.int32), values, indices, scores)


def finish(running: tuple[jax.Array, jax.Array], k: int) -> tuple[jax.Array, jax.Array]:
    """The first k of a running set ordered as the reference's top-k: `[B,R,keep+1] -> [B,R,k]`
    (score descending, lower key index first among ties; -inf slots INVALID)."""
    values, indices = (a[..., :-1] for a in running)
    order_key = ~_order_key(values)  # descending score; the stable sort keeps increasing index among ties
    _, values, indices = jax.lax.sort((order_key, values, indices), dimension=-1, num_keys=1, is_stable=True)
    values, indices = values[..., :k], indices[..., :k]
    return values, jnp.where(jnp.isneginf(values), INVALID, indices)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-0.0 below +0.0, -inf lowest): flip every bit of
    negative numbers, only the sign bit of the others."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return bits ^ jnp.where(negative, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))


def _select_kernel(first_ref, val_ref, idx_ref, score_ref, out_val_ref, out_idx_ref, *, keep: int):
    """Rows [r, keep + 1] running entries and [r, n] block scores -> the rows' new running sets."""
    run_val = val_ref[:, pl.ds(0, keep)]  # [r, keep]
    run_idx = idx_ref[:, pl.ds(0, keep)]
    new_val = score_ref[...]  # [r, n]
    rows, block = new_val.shape
    new_idx = first_ref[0] + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
    run_key, new_key = _order_key(run_val), _order_key(new_val)

    def count_at_least(v):  # [r] -> [r] int32: keys >= v per row
        return (jnp.sum((run_key >= v[:, None]).astype(jnp.int32), axis=1)
                + jnp.sum((new_key >= v[:, None]).astype(jnp.int32), axis=1))

    def bit(i, t):  # decide bit 31 - i of the threshold
        candidate = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(count_at_least(candidate) >= keep, candidate, t)

    threshold = jax.lax.fori_loop(0, 32, bit, jnp.zeros((rows,), jnp.uint32))[:, None]  # keep-th largest key
    run_eq, new_eq = (run_key == threshold).astype(jnp.int32), (new_key == threshold).astype(jnp.int32)
    above = (jnp.sum((run_key > threshold).astype(jnp.int32), axis=1)
             + jnp.sum((new_key > threshold).astype(jnp.int32), axis=1))[:, None]
    ties_wanted = keep - above  # >= 1: the threshold itself is among the kept
    run_tie_rank = jnp.cumsum(run_eq, axis=1)
    new_tie_rank = jnp.sum(run_eq, axis=1)[:, None] + jnp.cumsum(new_eq, axis=1)
    run_sel = (run_key > threshold) | ((run_eq == 1) & (run_tie_rank <= ties_wanted))
    new_sel = (new_key > threshold) | ((new_eq == 1) & (new_tie_rank <= ties_wanted))
    run_pos = jnp.cumsum(run_sel.astype(jnp.int32), axis=1) - 1
    new_pos = jnp.sum(run_sel.astype(jnp.int32), axis=1)[:, None] + jnp.cumsum(new_sel.astype(jnp.int32), axis=1) - 1
    spare = jnp.int32(keep)
    run_rows = jax.lax.broadcasted_iota(jnp.int32, run_val.shape, 0)
    new_rows = jax.lax.broadcasted_iota(jnp.int32, new_val.shape, 0)
    for ref, run_x, new_x in ((out_val_ref, run_val, new_val), (out_idx_ref, run_idx, new_idx)):
        pltriton.store(ref.at[run_rows, jnp.where(run_sel, run_pos, spare)], run_x)
        pltriton.store(ref.at[new_rows, jnp.where(new_sel, new_pos, spare)], new_x)
