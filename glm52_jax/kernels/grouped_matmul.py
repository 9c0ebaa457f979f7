"""Grouped matmul for the routed experts (Pallas, Triton backend): `lax.ragged_dot` without the dense expansion.

XLA:GPU lowers `lax.ragged_dot` densely: a masked copy of the rows per group, G times the work and a
`[M, G, K]` temporary (25.8 GB in the 2M whole-prompt prefill). This kernel multiplies each row only
by its own group's kernel.

Rows arrive sorted by group (`group_sizes: [G]`, rows past `sum(group_sizes)` belong to no group and
come out as zeros, as from `lax.ragged_dot`). The rows are cut into tiles of `block_m` rows that never
straddle two groups; a tile table (group, first row, end row) is computed in jnp, at most
`cdiv(M, block_m) + G` tiles, and the unused tail entries are empty. The grid is (tile, output-column
block): each program accumulates `lhs[rows] @ rhs[g][:, cols]` over K blocks in float32 and stores its
rows; the output starts as zeros (an aliased input), so rows no tile covers stay zero.

`grouped_matmul` carries a custom VJP: the row gradient is the same kernel against the transposed
kernels (`dy @ rhs[g]^T`, no transposed copy: the kernel loads the blocks transposed); the kernel
gradient (`lhs_g^T dy_g`, only needed when the base weights are trained, which LoRA runs never do) is
`lax.ragged_dot`'s own transpose, which XLA drops when nothing uses it.

Axis letters: M rows, K contraction, N output columns, G groups, T tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from glm52_jax import kernels


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


def tile_table(group_sizes: jax.Array, rows: int, block_m: int) -> jax.Array:
    """`group_sizes: [G]` -> `[3, T]` int32 (group, first row, end row) of each tile; T = cdiv(rows, block_m) + G.

    Tiles of one group cover its rows in order; unused tiles have first = end = 0 (they store nothing).
    """
    groups = group_sizes.shape[0]
    count = -(-rows // block_m) + groups
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
    return jnp.stack([jnp.where(used, gc, 0), jnp.where(used, first, 0), jnp.where(used, end, 0)])


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _kernel(table_ref, lhs_ref, rhs_ref, zeros_ref, out_ref, *, num_groups, block_m, block_k, block_n, steps,
            transpose_rhs):
    del zeros_ref  # aliased to out_ref: rows no tile stores stay zero
    t, j = pl.program_id(0), pl.program_id(1)
    g, first, end = table_ref[0, t], table_ref[1, t], table_ref[2, t]
    rows = first + jnp.arange(block_m, dtype=jnp.int32)
    live = rows < end
    # Masked lanes keep distinct in-range rows outside [first, end) (the wrap lands below `first`, as
    # block_m <= M): the GPU never touches them, and interpret mode, which writes a masked lane's old
    # value back, then never collides with a live row of the same store.
    rows = rows % lhs_ref.shape[0]
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    dtype = rhs_ref.dtype
    precision = _precision(dtype)
    # rhs_ref: the kernels flattened to [G*K, N] (or [G*N, K] when transposed); group g's rows start at
    # g * rows_per_group (one indexer per load: the Triton lowering takes no nested `.at`).
    base = g * (rhs_ref.shape[0] // num_groups)

    def body(step, acc):
        ks = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        x = plgpu.load(lhs_ref.at[rows[:, None], ks[None, :]], mask=live[:, None], other=0).astype(dtype)
        if transpose_rhs:  # rhs[g]: [N, K]; the block [block_n, block_k] used transposed
            w = plgpu.load(rhs_ref.at[base + cols[:, None], ks[None, :]])
            return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                             precision=precision)
        w = plgpu.load(rhs_ref.at[base + ks[:, None], cols[None, :]])
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=live[:, None])


def _call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, block_m, rows_hint):
    """`lhs: [M, K]`, `rhs: [G, K, N]` (or `[G, N, K]` with transpose_rhs) -> `[M, N]` out_dtype."""
    m, k = lhs.shape
    if m < block_m:  # the tile must fit in the rows (see `_kernel`); pad rows belong to no group
        out = _call(jnp.pad(lhs, ((0, block_m - m), (0, 0))), rhs, group_sizes, transpose_rhs=transpose_rhs,
                    out_dtype=out_dtype, block_m=block_m, rows_hint=rows_hint)
        return out[:m]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    block_k, block_n = _block(k, 64), _block(n, 128)
    table = tile_table(group_sizes, m, block_m)
    kernel = functools.partial(_kernel, num_groups=rhs.shape[0], block_m=block_m, block_k=block_k,
                               block_n=block_n, steps=k // block_k, transpose_rhs=transpose_rhs)
    rhs = rhs.reshape(-1, rhs.shape[-1])
    whole = lambda shape: pl.BlockSpec(shape, lambda t, j: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(table.shape[1], n // block_n),
        in_specs=[whole(table.shape), whole(lhs.shape), whole(rhs.shape), whole((m, n))],
        out_specs=whole((m, n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=kernels.interpret(),
        # The name carries the rows expected to be live: plan mode (plan/hlo.py) counts the kernel's FLOPs
        # from it (a worst-case-sized EP receive buffer is mostly empty tiles).
        # The live rows read and written, each group's kernel block read (once per group: its tiles run
        # together), the zero-initialised output written once.
        name=kernels.traffic_name(f"grouped_matmul{'_t' if transpose_rhs else ''}_rows{min(rows_hint, m)}",
                                  min(rows_hint, m) * (k * lhs.dtype.itemsize + n * jnp.dtype(out_dtype).itemsize)
                                  + rhs.nbytes + m * n * jnp.dtype(out_dtype).itemsize),
    )(table, lhs, rhs, jnp.zeros((m, n), out_dtype))


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
