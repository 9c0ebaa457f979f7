"""Pallas (Triton backend) kernels of the sparse MLA attention; `kernels/sparse_mla.py` wires them up.

Every kernel reads the selected key rows straight from one or two row tables with a pointer gather
(no gathered copy in memory): table A `[Ra, C]` / `[Ra, R]` and optionally table B (a chunk's own
rows beside a cache, read in place). Rows are addressed in the virtual concatenation [A; B]; a
slot's row id is encoded as `r >= 0` (attend to row r) or `-(r0 + 1)` (a masked slot, which reads
row r0 -- the row index 0 of its batch maps to -- and contributes like the reference's masked
slots: weight 0, or 1/K each when the whole query is masked).

A c_kv table may hold e4m3 rows with one float32 scale per row (an FP8 cache, `model/cache_fp8.py`): its scale
vector rides beside the tables and each gathered row is dequantized as it is loaded (value x scale in float32,
rounded once to the compute dtype: `cache_fp8.read_rows`' arithmetic).

Kernels (one program per query token and its heads in one tile `[Hp, *]`, so the heads are the
MMA's M dimension and every gathered row is used by all of them):
- `forward`: streams blocks of `block_k` selected rows, `s = (q_lat kv^T + q_rope kr^T) * scale`,
  online softmax, `acc += p kv`; split over the slots (`splits` programs per query, partial results
  combined by log-sum-exp outside) when there are too few queries to fill the GPU (decode).
- `backward` (per query and block of `block_h` heads, which keeps its four [heads, C] operand tiles in
  shared memory): recomputes `p = exp(s - m) / l`, `dp = do kv^T`, `ds = p (dp - delta)`, accumulates
  `dq_lat = ds kv * scale`, `dq_rope = ds kr * scale` over the slots and writes each slot's key-row
  gradient `p^T do + ds^T q_lat * scale` ([C]) and `ds^T q_rope * scale` ([R]) as per-slot rows
  (one partial per head block).
- `segment_sum`: adds the per-slot rows (all partials) into the row tables' gradients in a fixed
  order (deterministic; no atomics): entries sorted by row, one program per run of equal rows.

Axis letters: N query tokens (batch x sequence), Hp padded heads, C latent (value) width, R rope
width, K selected slots, E entries (N x K).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from glm52_jax import kernels

MASKED = -1e30  # the reference's finite mask value: a fully masked query averages its masked slots


def _precision(dtype):
    # float32 inputs must not be rounded to TF32 by the GPU's MMA (the references run at highest).
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _dot(a, b, precision):
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _dot_t(a, b, precision):
    """`a @ b^T`."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)


def _dot_tn(a, b, precision):
    """`a^T @ b`."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)


def decode_rows(code):
    """Encoded row ids `[bk]` -> (valid mask, row to read)."""
    valid = code >= 0
    return valid, jnp.where(valid, code, -code - 1)


def _gather(refs, scale_refs, rows, split_row, dtype):
    """Rows `[bk]` of the table(s) `refs = (A,) or (A, B)` -> `[bk, width]` in `dtype`. A table with a scale
    ref (`scale_refs`, aligned with `refs`: e4m3 rows, one float32 scale per row) is dequantized as
    `cache_fp8.read_rows` does: value x scale in float32, rounded once to `dtype`."""
    if len(refs) == 1:
        return _dequantize(refs[0][rows, :], scale_refs[0], rows, None, dtype)
    table_a, table_b = refs
    in_a = rows < split_row
    rows_a, rows_b = jnp.where(in_a, rows, 0), jnp.where(in_a, 0, rows - split_row)
    from_a = _dequantize(_masked_rows(table_a, rows_a, in_a), scale_refs[0], rows_a, in_a, dtype)
    from_b = _dequantize(_masked_rows(table_b, rows_b, ~in_a), scale_refs[1], rows_b, ~in_a, dtype)
    # A select, not a sum: the masked-off lanes of an e4m3 table are undefined (see `_masked_rows`).
    return jnp.where(in_a[:, None], from_a, from_b)


def _dequantize(values, scale_ref, rows, mask, dtype):
    """Gathered rows `[bk, width]` in `dtype`; with `scale_ref` (float32 `[rows]`), times their rows' scales."""
    if scale_ref is None:
        return values.astype(dtype)
    row_scale = plgpu.load(scale_ref.at[rows], mask=mask, other=None if mask is None else 1.0)
    return (values.astype(jnp.float32) * row_scale[:, None]).astype(dtype)


def _masked_rows(table, rows, mask):
    """`table[rows]` where `mask` ([bk]), zeros elsewhere (undefined for 1-byte rows): only the masked-in rows are
    read."""
    # Full-array indices (not `rows, :`): the form both the Triton lowering and interpret mode take.
    cols = jnp.arange(table.shape[1], dtype=jnp.int32)[None, :]
    # No fill for float8 rows (Triton cannot splat an integer fill into float8 lanes): callers select around them.
    fill = None if jnp.dtype(table.dtype).itemsize == 1 else 0
    return plgpu.load(table.at[rows[:, None], cols], mask=mask[:, None], other=fill)


def _scores(ql, qr, kv, kr, valid, scale, precision):
    """Masked scaled logits `[Hp, bk]` (float32)."""
    s = _dot_t(ql, kv, precision) + _dot_t(qr, kr, precision)
    return jnp.where(valid[None, :], s * scale, MASKED)


# -- forward ------------------------------------------------------------------------------------

def _split_refs(refs, num_tables, scaled):
    """The kernels' table refs: (kv tables, kr tables, kv scale refs aligned with the kv tables (None where a table
    has no scales), the refs after them)."""
    kv_refs, kr_refs = refs[:num_tables], refs[num_tables:2 * num_tables]
    rest = list(refs[2 * num_tables:])
    scale_refs = tuple(rest.pop(0) if has else None for has in scaled)
    return kv_refs, kr_refs, scale_refs, rest


def _forward_kernel(code_ref, ql_ref, qr_ref, *refs, num_tables, scaled, split_row, scale, block_k, steps):
    kv_refs, kr_refs, scale_refs, (o_ref, m_ref, l_ref) = _split_refs(refs, num_tables, scaled)
    ql, qr = ql_ref[...], qr_ref[...]
    precision = _precision(ql.dtype)
    heads, width = ql.shape

    def body(j, carry):
        acc, m, l = carry
        valid, rows = decode_rows(code_ref[pl.ds(j * block_k, block_k)])
        kv = _gather(kv_refs, scale_refs, rows, split_row, ql.dtype)
        kr = _gather(kr_refs, (None,) * num_tables, rows, split_row, ql.dtype)
        s = _scores(ql, qr, kv, kr, valid, scale, precision)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(kv.dtype), kv, precision)
        return acc, m_new, l

    init = (jnp.zeros((heads, width), jnp.float32), jnp.full((heads,), -jnp.inf, jnp.float32),
            jnp.zeros((heads,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, steps, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def _scale_args(kv_scales, num_tables):
    """(static per-table flags, the scale vectors present) of `kv_scales` (None, or one entry per kv table:
    a float32 [rows] vector or None)."""
    kv_scales = (None,) * num_tables if kv_scales is None else tuple(kv_scales)
    return tuple(s is not None for s in kv_scales), [s for s in kv_scales if s is not None]


def forward(codes, q_lat, q_rope, kv_tables, kr_tables, *, scale, block_k, splits, num_warps, num_stages,
            interpret, out_dtype, kv_scales=None):
    """codes: [N, K] (K a multiple of splits * block_k); q_lat: [N, Hp, C]; q_rope: [N, Hp, R]; tables as
    in `_gather`; kv_scales: None or per kv table its rows' float32 scales [Ra] (e4m3 rows) or None.
    Returns per split (o [N, splits, Hp, C] normalised, m [N, splits, Hp], l [N, splits, Hp])."""
    n, k = codes.shape
    _, heads, width = q_lat.shape
    rope = q_rope.shape[-1]
    per_split = k // splits
    scaled, scale_vectors = _scale_args(kv_scales, len(kv_tables))
    kernel = functools.partial(_forward_kernel, num_tables=len(kv_tables), scaled=scaled,
                               split_row=kv_tables[0].shape[0], scale=scale, block_k=block_k,
                               steps=per_split // block_k)
    whole = [pl.BlockSpec(t.shape, functools.partial(_origin, t.ndim))
             for t in (*kv_tables, *kr_tables, *scale_vectors)]
    return pl.pallas_call(
        kernel,
        grid=(n, splits),
        in_specs=[pl.BlockSpec((None, per_split), lambda i, j: (i, j)),
                  pl.BlockSpec((None, heads, width), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec((None, heads, rope), lambda i, j: (i, 0, 0)), *whole],
        out_specs=[pl.BlockSpec((None, None, heads, width), lambda i, j: (i, j, 0, 0)),
                   pl.BlockSpec((None, None, heads), lambda i, j: (i, j, 0)),
                   pl.BlockSpec((None, None, heads), lambda i, j: (i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, splits, heads, width), out_dtype),
                   jax.ShapeDtypeStruct((n, splits, heads), jnp.float32),
                   jax.ShapeDtypeStruct((n, splits, heads), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        # Reads each query's K selected rows (not the whole tables it is given), writes o, m, l.
        # FLOPs: per query, head and selected row the score over C + R dims and the value sum over C.
        name=kernels.traffic_name("sparse_mla_forward", codes.nbytes + q_lat.nbytes + q_rope.nbytes
                                  + n * k * (width * kv_tables[0].dtype.itemsize
                                             + rope * kr_tables[0].dtype.itemsize + 4 * len(scale_vectors))
                                  + n * splits * heads * (width * jnp.dtype(out_dtype).itemsize + 8),
                                  flops=2 * n * k * heads * (2 * width + rope)),
    )(codes, q_lat, q_rope, *kv_tables, *kr_tables, *scale_vectors)


# -- backward -----------------------------------------------------------------------------------

def _backward_kernel(code_ref, ql_ref, qr_ref, do_ref, m_ref, l_ref, delta_ref, *refs, num_tables, scaled,
                     split_row, scale, block_k, steps):
    kv_refs, kr_refs, scale_refs, (dql_ref, dqr_ref, dkv_ref, dkr_ref) = _split_refs(refs, num_tables, scaled)
    ql, qr, do = ql_ref[...], qr_ref[...], do_ref[...]
    m, inv_l, delta = m_ref[...], 1.0 / l_ref[...], delta_ref[...]
    precision = _precision(ql.dtype)

    def body(j, carry):
        dql, dqr = carry
        slots = pl.ds(j * block_k, block_k)
        valid, rows = decode_rows(code_ref[slots])
        kv = _gather(kv_refs, scale_refs, rows, split_row, ql.dtype)
        kr = _gather(kr_refs, (None,) * num_tables, rows, split_row, ql.dtype)
        s = _scores(ql, qr, kv, kr, valid, scale, precision)
        p = jnp.exp(s - m[:, None]) * inv_l[:, None]  # [Hp, bk]
        dp = _dot_t(do, kv, precision)
        # Masked slots hold a constant logit: no gradient reaches q or the rows through them.
        ds = jnp.where(valid[None, :], p * (dp - delta[:, None]), 0.0) * scale
        ds_in = ds.astype(ql.dtype)
        dql = dql + _dot(ds_in, kv, precision)
        dqr = dqr + _dot(ds_in, kr, precision)
        dkv = _dot_tn(p.astype(do.dtype), do, precision) + _dot_tn(ds_in, ql, precision)  # [bk, C]
        dkv_ref[slots, :] = dkv
        dkr_ref[slots, :] = _dot_tn(ds_in, qr, precision)
        return dql, dqr

    init = (jnp.zeros(ql.shape, jnp.float32), jnp.zeros(qr.shape, jnp.float32))
    dql, dqr = jax.lax.fori_loop(0, steps, body, init)
    dql_ref[...] = dql
    dqr_ref[...] = dqr


def backward(codes, q_lat, q_rope, d_out, m, l, delta, kv_tables, kr_tables, *, scale, block_k, block_h, splits,
             num_warps, num_stages, interpret, kv_scales=None):
    """Per query, head block of `block_h` heads and slot split: dq partial sums (float32 [N, splits, Hp, C] /
    [.., R]) and the head block's share of the per-slot key-row gradients (float32 [Hp/block_h, N, K, C] /
    [.., R]; for a scaled table's slots, the gradient of the dequantized row). m, l, delta: [N, Hp] float32
    (delta = rowsum(do * o) - dlse); kv_scales as in `forward`.

    Head blocks keep the per-program tiles within shared memory: q_lat and do each serve as an MMA
    operand on both sides (A of q kv^T / do kv^T, B of ds^T q / p^T do), four [block_h, C] tiles.
    """
    n, k = codes.shape
    _, heads, width = q_lat.shape
    rope = q_rope.shape[-1]
    per_split = k // splits
    head_blocks = heads // block_h
    scaled, scale_vectors = _scale_args(kv_scales, len(kv_tables))
    kernel = functools.partial(_backward_kernel, num_tables=len(kv_tables), scaled=scaled,
                               split_row=kv_tables[0].shape[0], scale=scale, block_k=block_k,
                               steps=per_split // block_k)
    whole = [pl.BlockSpec(t.shape, functools.partial(_origin, t.ndim))
             for t in (*kv_tables, *kr_tables, *scale_vectors)]
    per_head = pl.BlockSpec((None, block_h), lambda i, h, j: (i, h))

    def tile(w):
        return pl.BlockSpec((None, block_h, w), lambda i, h, j: (i, h, 0))

    def dq_tile(w):
        return pl.BlockSpec((None, None, block_h, w), lambda i, h, j: (i, j, h, 0))

    def rows_tile(w):
        return pl.BlockSpec((None, None, per_split, w), lambda i, h, j: (h, i, j, 0))

    return pl.pallas_call(
        kernel,
        grid=(n, head_blocks, splits),
        in_specs=[pl.BlockSpec((None, per_split), lambda i, h, j: (i, j)), tile(width), tile(rope), tile(width),
                  per_head, per_head, per_head, *whole],
        out_specs=[dq_tile(width), dq_tile(rope), rows_tile(width), rows_tile(rope)],
        out_shape=[jax.ShapeDtypeStruct((n, splits, heads, width), jnp.float32),
                   jax.ShapeDtypeStruct((n, splits, heads, rope), jnp.float32),
                   jax.ShapeDtypeStruct((head_blocks, n, k, width), jnp.float32),
                   jax.ShapeDtypeStruct((head_blocks, n, k, rope), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        # Per head block: q, do and the K selected rows read; dq partials and per-slot row gradients written.
        # FLOPs: the scores again (C + R), dP = dO.V (C), dQ = dS.K and dK = dS^T.Q (C + R each), dV = P^T.dO (C).
        name=kernels.traffic_name("sparse_mla_backward", codes.nbytes + 2 * q_lat.nbytes + q_rope.nbytes
                                  + 3 * m.nbytes + head_blocks * n * k * (width + rope) * (
                                      kv_tables[0].dtype.itemsize + 4) + n * splits * heads * (width + rope) * 4,
                                  flops=2 * n * k * heads * (3 * (width + rope) + 2 * width)),
    )(codes, q_lat, q_rope, d_out, m, l, delta, *kv_tables, *kr_tables, *scale_vectors)


# -- deterministic scatter-add ------------------------------------------------------------------

def _origin(ndim, *_):
    return (0,) * ndim


def _segment_sum_kernel(keys_ref, ends_ref, order_ref, src_ref, acc_in_ref, acc_ref, *, num_rows, block_e,
                        partials):
    del acc_in_ref  # aliased with acc_ref
    i = pl.program_id(0)
    row = keys_ref[i]
    prev = keys_ref[jnp.maximum(i - 1, 0)]
    head = ((i == 0) | (prev != row)) & (row >= 0) & (row < num_rows)

    @pl.when(head)
    def _():
        end = ends_ref[i]
        entries = src_ref.shape[0] // partials

        def body(c, total):
            e = i + c * block_e + jnp.arange(block_e, dtype=jnp.int32)
            inside = e < end
            entry = plgpu.load(order_ref.at[jnp.where(inside, e, i)], mask=inside, other=0)
            for part in range(partials):
                total = total + jnp.sum(_masked_rows(src_ref, entry + part * entries, inside), axis=0)
            return total

        steps = (end - i + block_e - 1) // block_e
        total = jax.lax.fori_loop(0, steps, body, jnp.zeros((src_ref.shape[1],), jnp.float32))
        acc_ref[row, :] = acc_ref[row, :] + total


def segment_sum(keys, ends, order, src, acc, *, block_e, interpret):
    """`acc[keys[e]] += sum_p src[p, order[e]]` for sorted `keys: [E]` (keys outside acc's rows are dropped),
    summed per row in entry order (deterministic). ends: [E] end (exclusive) of each entry's run of equal
    keys; src: [P, E, W] float32 partial rows; acc: [Rows, W] float32 (updated in place)."""
    partials, entries, width = src.shape
    kernel = functools.partial(_segment_sum_kernel, num_rows=acc.shape[0], block_e=block_e, partials=partials)
    src = src.reshape(partials * entries, width)
    whole = [pl.BlockSpec(x.shape, functools.partial(_origin, x.ndim)) for x in (keys, ends, order, src, acc)]
    return pl.pallas_call(
        kernel,
        grid=(keys.shape[0],),
        in_specs=whole,
        out_specs=pl.BlockSpec(acc.shape, lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct(acc.shape, acc.dtype),
        input_output_aliases={4: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1 if width <= 128 else 4, num_stages=2),
        interpret=interpret,
        name="sparse_mla_segment_sum",
    )(keys, ends, order, src, acc)
