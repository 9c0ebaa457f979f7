"""Grouped matmul for the routed experts (Pallas, Triton backend): `lax.ragged_dot` without the dense expansion.

XLA:GPU lowers `lax.ragged_dot` densely: a masked copy of the rows per group, G times the work and a
`[M, G, K]` temporary (25.8 GB in the 2M whole-prompt prefill). This kernel multiplies each row only
by its own group's kernel.

Rows arrive sorted by group (`group_sizes: [G]`, rows past `sum(group_sizes)` belong to no group and
come out as zeros, as from `lax.ragged_dot`). The rows are cut into tiles of `block_m` rows that never
straddle two groups; a tile table (group, first row, end row) is computed in jnp, at most
`cdiv(M, block_m) + G + 1` tiles: each group's, then tiles that store the rows past every group as zeros, and
the unused tail entries are empty. The grid is (tile, output-column block): each program accumulates
`lhs[rows] @ rhs[g][:, cols]` over K blocks in float32 and stores its rows. Every row is stored once, so the
output is a fresh buffer (no zero-filled input aliased to it, which XLA filled and copied per call).

`grouped_matmul` carries a custom VJP: the row gradient is the same kernel against the transposed
kernels (`dy @ rhs[g]^T`, no transposed copy: the kernel loads the blocks transposed); the kernel
gradient (`lhs_g^T dy_g`, only needed when the base weights are trained, which LoRA runs never do) is
`lax.ragged_dot`'s own transpose, which XLA drops when nothing uses it.

FP8 kernels (`model.fp8`: e4m3 values + float32 block scales, `grouped_matmul_fp8`) are dequantized inside
the kernel, block by block as they are loaded: each program reads the e4m3 bytes of its group's blocks and
the scales of the blocks they fall in, and multiplies `value x scale` in float32, rounded once to the
compute dtype, as `fp8.dense` does for the whole weight. So the products are those of the kernel on
`fp8.dense(rhs)`, without the dequantized copy of every local expert's kernels that `fp8.dense` writes to
HBM (2.4 GB of bf16 per layer for GLM-5.2's 32 experts per device at EP 8) and reads back.
The frozen FP8 kernels get no gradient (zeros, which XLA drops); the rows' gradient is the transposed
kernel, dequantized the same way.

Axis letters: M rows, K contraction, N output columns, G groups, T tiles; SK, SN the scale grid of K, N.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from glm52_jax import kernels
from glm52_jax.kernels import fp8_dot
from glm52_jax.kernels.indexer import quantize_e4m3

W8A8_BLOCK = 128  # FP8 rows x FP8 kernels: one scale per 128 of a row's K, one per 128 x 128 block of a kernel


def _block(dim: int, preferred: int) -> int | None:
    """The largest power of two <= preferred that divides `dim` and is >= 16 (Triton's smallest dot)."""
    b = preferred
    while b >= 16:
        if dim % b == 0:
            return b
        b //= 2
    return None


def supported(lhs_shape, rhs_shape, dtype) -> bool:
    """Whether the kernel takes these operands (else callers use `lax.ragged_dot`)."""
    k, n = rhs_shape[-2], rhs_shape[-1]
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
            and _block(k, 64) is not None and _block(n, 128) is not None)


def w8a8_supported(k: int, n: int, block) -> bool:
    """Whether `grouped_matmul_w8a8` takes `[K, N]` kernels quantized in `block`s (else: the jnp reference)."""
    return k % W8A8_BLOCK == 0 and n % W8A8_BLOCK == 0 and tuple(block) == (W8A8_BLOCK, W8A8_BLOCK)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x: [M, K]` -> (e4m3 `[M, K]`, float32 scales `[M, ceil(K / 128)]`): each 128-wide block of a row (a partial
    last one its own) quantized as the FP8 indexer's rows are (`quantize_e4m3`: scale = amax / 448, value =
    e4m3(x x 1/scale))."""
    m, k = x.shape
    blocks = -(-k // W8A8_BLOCK)
    padded = jnp.pad(x, ((0, 0), (0, blocks * W8A8_BLOCK - k)))  # zeros raise no block's amax
    values, scales = quantize_e4m3(padded.reshape(m, blocks, W8A8_BLOCK))
    return values.reshape(m, blocks * W8A8_BLOCK)[:, :k], scales


def tile_table(group_sizes: jax.Array, rows: int, block_m: int) -> jax.Array:
    """`group_sizes: [G]` -> `[3, T]` int32 (group, first row, end row) of each tile; T = cdiv(rows, block_m) + G + 1.

    Tiles of one group cover its rows in order; then tiles of group G (none) cover the rows past sum(group_sizes),
    which the kernel stores as zeros; unused tiles have first = end = 0 (they store nothing). Every output row is
    stored by exactly one tile, so the output needs no zero-filled buffer.
    """
    groups = group_sizes.shape[0]
    count = -(-rows // block_m) + groups + 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles)
    t = jnp.arange(count, dtype=jnp.int32)
    g = jnp.searchsorted(tile_ends, t, side="right").astype(jnp.int32)  # group of tile t (G: unused)
    used = g < groups
    gc = jnp.minimum(g, groups - 1)
    first = starts[gc] + (t - (tile_ends[gc] - tiles[gc])) * block_m
    end = jnp.minimum(first + block_m, ends[gc])
    total, used_tiles = ends[-1], tile_ends[-1]
    tail_first = total + (t - used_tiles) * block_m  # tiles after the groups': the rows past every group
    tail = ~used & (tail_first < rows)
    return jnp.stack([jnp.where(used, gc, jnp.where(tail, groups, 0)),
                      jnp.where(used, first, jnp.where(tail, tail_first, 0)),
                      jnp.where(used, end, jnp.where(tail, jnp.minimum(tail_first + block_m, rows), 0))])


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _kernel(table_ref, lhs_ref, rhs_ref, *refs, num_groups, block_m, block_k, block_n, steps, transpose_rhs,
            scale_block, dtype, fp8_rows):
    # refs: (row scales, scales, out) for FP8 rows times an FP8 rhs (fp8_rows), (scales, out) for an FP8 rhs
    # dequantized (scale_block set), else (out,). A tile of group G (`tile_table`: rows past every group) runs no
    # step and stores zeros.
    row_scales_ref = refs[0] if fp8_rows else None
    scales_ref, out_ref = (refs[-2], refs[-1]) if scale_block else (None, refs[-1])
    t, j = pl.program_id(0), pl.program_id(1)
    g, first, end = table_ref[0, t], table_ref[1, t], table_ref[2, t]
    rows = first + jnp.arange(block_m, dtype=jnp.int32)
    live = rows < end
    # Masked lanes keep distinct in-range rows outside [first, end) (the wrap lands below `first`, as
    # block_m <= M): the GPU never touches them, and interpret mode, which writes a masked lane's old
    # value back, then never collides with a live row of the same store.
    rows = rows % lhs_ref.shape[0]
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    precision = _precision(dtype)
    # rhs_ref: the kernels flattened to [G*K, N] (or [G*N, K] when transposed); group g's rows start at
    # g * rows_per_group (one indexer per load: the Triton lowering takes no nested `.at`).
    base = g * (rhs_ref.shape[0] // num_groups)

    def weights(r, c):
        """rhs[g][r, c] (`r`, `c`: index arrays on the rhs's own [K, N] dims) in the compute dtype; an FP8
        block dequantized by the scales of the blocks its elements fall in (scales: [G*SK, SN])."""
        w = plgpu.load(rhs_ref.at[base + r, c])
        if not scale_block:
            return w
        s = plgpu.load(scales_ref.at[g * (scales_ref.shape[0] // num_groups) + r // scale_block[0],
                                     c // scale_block[1]])
        return (w.astype(jnp.float32) * s).astype(dtype)

    def body_fp8(step, acc):
        # e4m3 rows x e4m3 kernel block on FP8 tensor cores, float32 sums of one 128-wide K block, then scaled by the
        # rows' scales of that block and the kernel block's one scale (block_k = block_n = the scale block).
        ks = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        # Unmasked: every lane's row is in range (see above) and a dead lane's sums are never stored (Triton casts
        # no integer `other` to e4m3).
        x = plgpu.load(lhs_ref.at[rows[:, None], ks[None, :]])
        x_scale = plgpu.load(row_scales_ref.at[rows, step])  # [block_m]
        w = plgpu.load(rhs_ref.at[base + ks[:, None], cols[None, :]])
        w_scale = scales_ref[g * (scales_ref.shape[0] // num_groups) + step, j]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32) * (x_scale[:, None] * w_scale)

    def body(step, acc):
        ks = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        x = plgpu.load(lhs_ref.at[rows[:, None], ks[None, :]], mask=live[:, None], other=0).astype(dtype)
        if transpose_rhs:  # rhs[g]: [N, K]; the block [block_n, block_k] used transposed
            w = weights(cols[:, None], ks[None, :])
            return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                             precision=precision)
        w = weights(ks[:, None], cols[None, :])
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)

    # No step for a zero tile nor an unused one (first = end: it stores nothing).
    count = steps * ((g < num_groups) & (end > first)).astype(jnp.int32)
    acc = jax.lax.fori_loop(0, count, body_fp8 if fp8_rows else body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=live[:, None])


def _call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, block_m, rows_hint, scales=None, scale_block=None,
          dtype=None, row_scales=None):
    """`lhs: [M, K]`, `rhs: [G, K, N]` (or `[G, N, K]` with transpose_rhs) -> `[M, N]` out_dtype.

    FP8: `rhs` e4m3 with `scales: [G, SK, SN]` float32 over blocks `scale_block` of rhs's own last two dims,
    dequantized to `dtype` in the kernel; else `rhs` is in the compute dtype (`dtype` = rhs.dtype). FP8 rows
    (`row_scales: [M, K / 128]` float32, `lhs` e4m3, `rhs` [G, K, N] e4m3 in 128 x 128 blocks): FP8 MMA."""
    m, k = lhs.shape
    if m < block_m:  # the tile must fit in the rows (see `_kernel`); pad rows belong to no group
        pad = lambda a: None if a is None else jnp.pad(a, ((0, block_m - m), (0, 0)))  # noqa: E731
        out = _call(pad(lhs), rhs, group_sizes, transpose_rhs=transpose_rhs,
                    out_dtype=out_dtype, block_m=block_m, rows_hint=rows_hint, scales=scales,
                    scale_block=scale_block, dtype=dtype, row_scales=pad(row_scales))
        return out[:m]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    fp8_rows = row_scales is not None
    # FP8 rows: one K step per 128-wide scale block, one output-column block per kernel scale block.
    block_k, block_n = (W8A8_BLOCK, W8A8_BLOCK) if fp8_rows else (_block(k, 64), _block(n, 128))
    table = tile_table(group_sizes, m, block_m)
    kernel = functools.partial(_kernel, num_groups=rhs.shape[0], block_m=block_m, block_k=block_k,
                               block_n=block_n, steps=k // block_k, transpose_rhs=transpose_rhs,
                               scale_block=None if scales is None else tuple(scale_block),
                               dtype=jnp.dtype(rhs.dtype if dtype is None else dtype), fp8_rows=fp8_rows)
    rhs = rhs.reshape(-1, rhs.shape[-1])
    operands = [table, lhs, rhs] + ([row_scales.astype(jnp.float32)] if fp8_rows else [])
    if scales is not None:
        operands.append(scales.astype(jnp.float32).reshape(-1, scales.shape[-1]))
    whole = lambda shape: pl.BlockSpec(shape, lambda t, j: (0,) * len(shape))  # noqa: E731
    rows = min(rows_hint, m)
    # Plan mode's classes (plan/kernel_cost.py): `_fp8` marks FP8 MMA (its own efficiency class); a bf16 product of
    # dequantized FP8 blocks is a grouped matmul like the bf16 kernel's.
    if fp8_rows:
        name = f"grouped_matmul_rows{rows}_fp8"
    else:
        name = f"grouped_matmul{'' if scales is None else '_dequant'}{'_t' if transpose_rhs else ''}_rows{rows}"
    return pl.pallas_call(
        kernel,
        grid=(table.shape[1], n // block_n),
        in_specs=[whole(x.shape) for x in operands],
        out_specs=whole((m, n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=kernels.interpret(),
        # The name carries the rows expected to be live: plan mode (plan/hlo.py) counts the kernel's FLOPs
        # from it (a worst-case-sized EP receive buffer is mostly empty tiles).
        # The live rows read and written, each group's kernel block read (once per group: its tiles run
        # together; an FP8 kernel's e4m3 bytes and its scales), the other rows written as zeros.
        name=kernels.traffic_name(name, rows * k * lhs.dtype.itemsize + m * n * jnp.dtype(out_dtype).itemsize
                                  + sum(x.nbytes for x in operands[2:])),
    )(*operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(lhs, rhs, group_sizes, block_m, rows_hint):
    return _call(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=jnp.float32, block_m=block_m,
                 rows_hint=rows_hint)


def _grouped_fwd(lhs, rhs, group_sizes, block_m, rows_hint):
    return _grouped(lhs, rhs, group_sizes, block_m, rows_hint), (lhs, rhs, group_sizes)


def _grouped_bwd(block_m, rows_hint, saved, dy):
    lhs, rhs, group_sizes = saved
    d_lhs = _call(dy.astype(rhs.dtype), rhs, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype,
                  block_m=block_m, rows_hint=rows_hint)
    _, rhs_vjp = jax.vjp(lambda w: jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32), rhs)
    (d_rhs,) = rhs_vjp(dy)
    return d_lhs, d_rhs, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped_fp8(lhs, values, scales, group_sizes, block_m, rows_hint, scale_block):
    return _call(lhs, values, group_sizes, transpose_rhs=False, out_dtype=jnp.float32, block_m=block_m,
                 rows_hint=rows_hint, scales=scales, scale_block=scale_block, dtype=lhs.dtype)


def _grouped_fp8_fwd(lhs, values, scales, group_sizes, block_m, rows_hint, scale_block):
    out = _grouped_fp8(lhs, values, scales, group_sizes, block_m, rows_hint, scale_block)
    # The rows' gradient needs only their dtype (carried by an empty array), not the rows.
    return out, (jnp.zeros((0,), lhs.dtype), values, scales, group_sizes)


def _grouped_fp8_bwd(block_m, rows_hint, scale_block, saved, dy):
    like, values, scales, group_sizes = saved
    dtype = like.dtype
    d_lhs = _call(dy.astype(dtype), values, group_sizes, transpose_rhs=True, out_dtype=dtype, block_m=block_m,
                  rows_hint=rows_hint, scales=scales, scale_block=scale_block, dtype=dtype)
    # The FP8 base is frozen (`fp8.dense` stops its gradient too): zero cotangents, which nothing uses.
    return d_lhs, jnp.zeros_like(values), jnp.zeros_like(scales), None


_grouped_fp8.defvjp(_grouped_fp8_fwd, _grouped_fp8_bwd)


def _w8a8_call(x8, x_scales, values, scales, group_sizes, block_m, rows_hint):
    """The FP8 MMA kernel on rows already quantized (`quantize_rows`) -> [M, N] float32."""
    fp8_dot.install()  # e4m3 dots as FP8 wgmma on sm_90a (kernels/fp8_dot.py)
    return _call(x8, values, group_sizes, transpose_rhs=False, out_dtype=jnp.float32, block_m=block_m,
                 rows_hint=rows_hint, scales=scales, scale_block=(W8A8_BLOCK, W8A8_BLOCK), row_scales=x_scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _grouped_w8a8(lhs, x8, x_scales, values, scales, group_sizes, block_m, rows_hint):
    # `lhs`: the unquantized rows (x8, x_scales: their quantization), whose gradient the backward gives.
    return _w8a8_call(x8, x_scales, values, scales, group_sizes, block_m, rows_hint)


def _grouped_w8a8_fwd(lhs, x8, x_scales, values, scales, group_sizes, block_m, rows_hint):
    out = _grouped_w8a8(lhs, x8, x_scales, values, scales, group_sizes, block_m, rows_hint)
    return out, (jnp.zeros((0,), lhs.dtype), values, scales, group_sizes)


def _grouped_w8a8_bwd(block_m, rows_hint, saved, dy):
    # Straight through the rows' quantization: the rows' gradient is dy times the dequantized kernel, transposed
    # (`grouped_matmul_fp8`'s backward), as if the forward had multiplied the unquantized rows; none to their
    # quantized form.
    d_lhs, d_values, d_scales, _ = _grouped_fp8_bwd(block_m, rows_hint, (W8A8_BLOCK, W8A8_BLOCK), saved, dy)
    return d_lhs, None, None, d_values, d_scales, None


_grouped_w8a8.defvjp(_grouped_w8a8_fwd, _grouped_w8a8_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_m: int = 64,
                   rows_hint: int | None = None) -> jax.Array:
    """`lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=float32)` as a Pallas kernel.

    lhs: [M, K] rows sorted by group; rhs: [G, K, N] (same dtype as lhs, bfloat16 or float32);
    group_sizes: [G] int32 (sum <= M) -> [M, N] float32. Differentiable in lhs and rhs.
    rows_hint: the live rows expected (default M), recorded in the kernel's name for plan mode's FLOPs.
    """
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"grouped_matmul: lhs {lhs.dtype} and rhs {rhs.dtype} must share a dtype")
    if not supported(lhs.shape, rhs.shape, lhs.dtype):
        raise ValueError(f"grouped_matmul: unsupported operands lhs {lhs.shape} rhs {rhs.shape} {lhs.dtype}")
    return _grouped(lhs, rhs, group_sizes.astype(jnp.int32), block_m, lhs.shape[0] if rows_hint is None else rows_hint)


def grouped_matmul_fp8(lhs: jax.Array, values: jax.Array, scales: jax.Array, block: tuple[int, int],
                       group_sizes: jax.Array, *, block_m: int = 64, rows_hint: int | None = None) -> jax.Array:
    """`grouped_matmul(lhs, dequantized rhs, ...)` with the rhs an FP8 kernel dequantized inside the kernel.

    lhs: [M, K] bfloat16 or float32 (the compute dtype: each rhs element is `value x scale` rounded to it);
    values: [G, K, N] float8_e4m3fn; scales: [G, ceil(K / block[0]), ceil(N / block[1])] float32, one per
    `block` of each group's [K, N] (`fp8.Fp8Weight` of an expert stack: its scales and block); group_sizes:
    [G] int32 -> [M, N] float32, equal to `grouped_matmul(lhs, fp8.dense(rhs), ...)`. Differentiable in lhs
    (the FP8 kernel is frozen: zero gradients).
    """
    g, k, n = values.shape
    grid = (g, -(-k // block[0]), -(-n // block[1]))
    if jnp.dtype(values.dtype) != jnp.dtype(jnp.float8_e4m3fn) or tuple(scales.shape) != grid:
        raise ValueError(f"grouped_matmul_fp8: values {values.dtype} {values.shape} with scales {scales.shape} in "
                         f"blocks {tuple(block)}; expected float8_e4m3fn values and scales {grid}")
    if not supported(lhs.shape, values.shape, lhs.dtype):
        raise ValueError(f"grouped_matmul_fp8: unsupported operands lhs {lhs.shape} rhs {values.shape} {lhs.dtype}")
    return _grouped_fp8(lhs, values, scales, group_sizes.astype(jnp.int32), block_m,
                        lhs.shape[0] if rows_hint is None else rows_hint, tuple(block))


def grouped_matmul_w8a8(lhs: jax.Array, values: jax.Array, scales: jax.Array, block: tuple[int, int],
                        group_sizes: jax.Array, *, block_m: int = 64, rows_hint: int | None = None,
                        quantized: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """FP8 rows times an FP8 kernel on FP8 tensor cores (w8a8, DeepSeek-V3's FP8 recipe for its experts).

    lhs: [M, K] bfloat16 or float32, sorted by group, quantized here per 128-wide block of each row
    (`quantize_rows`); values: [G, K, N] float8_e4m3fn; scales: [G, K / 128, N / 128] float32 (`block` must be
    128 x 128, K and N multiples of 128: `w8a8_supported`); group_sizes: [G] int32 -> [M, N] float32:
    `sum_kb (x8[:, kb] @ w8[g][kb, nb]) * x_scale[:, kb] * w_scale[g, kb, nb]`, each 128-long dot accumulated in
    float32 (Hopper's reduced-precision FP8 accumulation spans one such dot; `fp8_dot`). Differentiable in lhs,
    straight through the quantization (the gradient of the product with the unquantized rows); the FP8 kernel is
    frozen (zero gradients). `quantized`: lhs's `quantize_rows`, when the caller has it already.
    """
    g, k, n = values.shape
    if jnp.dtype(values.dtype) != jnp.dtype(jnp.float8_e4m3fn) or not w8a8_supported(k, n, block) \
            or tuple(scales.shape) != (g, k // W8A8_BLOCK, n // W8A8_BLOCK) or lhs.shape[-1] != k:
        raise ValueError(f"grouped_matmul_w8a8: lhs {lhs.shape}, values {values.dtype} {values.shape} with scales "
                         f"{scales.shape} in blocks {tuple(block)}; expected float8_e4m3fn values, 128 x 128 blocks "
                         f"and K, N multiples of 128")
    if jnp.dtype(lhs.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"grouped_matmul_w8a8: lhs must be bfloat16 or float32, got {lhs.dtype}")
    x8, x_scales = quantize_rows(jax.lax.stop_gradient(lhs)) if quantized is None else quantized
    return _grouped_w8a8(lhs, x8, x_scales, values, scales, group_sizes.astype(jnp.int32), block_m,
                         lhs.shape[0] if rows_hint is None else rows_hint)


def grouped_matmul_w8a8_rows(values_rows: jax.Array, row_scales: jax.Array, values: jax.Array, scales: jax.Array,
                             group_sizes: jax.Array, *, block_m: int = 64, rows_hint: int | None = None) -> jax.Array:
    """`grouped_matmul_w8a8` of rows already quantized (`quantize_rows`: values_rows [M, K] e4m3, row_scales
    [M, K / 128] float32), e.g. rows that travelled so; not differentiable (e4m3 operands)."""
    return _w8a8_call(values_rows, row_scales, values, scales, group_sizes.astype(jnp.int32), block_m,
                      values_rows.shape[0] if rows_hint is None else rows_hint)
