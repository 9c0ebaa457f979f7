"""Sparse MLA attention with Pallas kernels: forward (output + log-sum-exp) and a deterministic backward.

Same semantics as `model.sparse_attention.sparse_mla_rows` (the reference): every head of a query
attends, in absorbed MQA form, to the K key rows its top-k selected; key = [c_kv ; k_rope] (C + R
wide), value = c_kv; masked slots get the reference's finite logit -1e30, so a query with no valid
slot averages the row that index 0 maps to (what the reference's gather of index 0 gives).

The key rows stay where they are: one table `A` (a sequence's `c_kv` / `k_rope` flattened to rows)
or two (`A` a stacked decode cache read in place, `B` the chunk's own rows); see
`sparse_mla_kernels` for the kernels and the row-id encoding.

Backward (a `jax.custom_vjp`): dq from the per-query kernel; the key rows' gradient is the sum,
over every (query, slot) that selected a row, of that slot's row gradient. The kernel writes those
per-slot rows for a chunk of queries, they are sorted by row (stable) and summed per row in that
order by `segment_sum`: the result is deterministic, unlike an atomic scatter-add. Chunks of
queries bound the per-slot buffer to `KernelConfig.chunk_entries` x (C + R) float32.

Axis letters: B batch, S queries, H heads, C latent width, R rope width, K slots, N = B*S.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from glm52_jax.kernels import sparse_mla_kernels as kern


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiling of the sparse MLA kernels (static; part of the compiled program).

    block_k / num_warps / num_stages: slots per step, warps and software-pipeline depth of the forward;
    bwd_*: the same for the backward, which takes `bwd_block_h` heads per program. min_programs: fewer
    query tokens than this split the slots over several programs per query (decode), up to about this
    many programs in all. chunk_entries: (query, slot) entries whose per-slot key-row gradients the
    backward holds at once. segment_block: entries summed per step of the deterministic scatter-add.
    The steps and stages are upper limits: `sparse_mla_tables` runs `for_dtype(...).fitted(...)` of them.
    """

    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2
    bwd_block_k: int = 32
    bwd_block_h: int = 32
    bwd_num_warps: int = 8
    bwd_num_stages: int = 1
    min_programs: int = 264
    chunk_entries: int = 1 << 18
    segment_block: int = 16

    def for_dtype(self, dtype) -> KernelConfig:
        """The tiles' register limits for inputs of `dtype`: 4-byte inputs (float32 parity runs) double every
        gathered tile's registers, so 16-slot steps (sm_90a, C 512, two tables: 32-slot steps fit shared memory,
        221,440 B, but ptxas spilled 87,556 B per thread; 16-slot steps 0), 16-head backward blocks and 4 warps.
        Shared memory is `fitted`'s."""
        if jnp.dtype(dtype).itemsize < 4:
            return self
        return dataclasses.replace(self, block_k=min(self.block_k, 16), bwd_block_k=min(self.bwd_block_k, 16),
                                   bwd_block_h=min(self.bwd_block_h, 16), bwd_num_warps=4, bwd_num_stages=1)

    def fitted(self, dtype, tables: int, heads: int, latent: int, rope: int, slots: int,
               limit: int | None = None, scaled: int = 0) -> KernelConfig:
        """These tiles made to fit `limit` bytes of shared memory per block (default sm_90's) for `tables` row
        tables of inputs of `dtype` and `heads` (padded) x (`latent` + `rope`) query tiles: the forward keeps its
        software pipeline (num_stages >= 2) and the largest step of at most `block_k` slots that fits with it,
        one stage only when no 16-slot step fits with two; the backward likewise. Steps never exceed the slots
        (rounded up to a power of two >= 16). `scaled` of the tables are e4m3 c_kv rows with per-row float32
        scales (an FP8 cache). Sizes by `forward_shared_memory` / `backward_shared_memory` (upper bounds of the
        compiled kernels' use, checked against sm_90a compiles)."""
        limit = SHARED_MEMORY_PER_BLOCK if limit is None else limit
        itemsize, cap = jnp.dtype(dtype).itemsize, _pow2_at_least(slots, 16)

        def fwd(block_k, stages):
            return forward_shared_memory(heads, latent, rope, itemsize, tables, block_k, stages, scaled)

        def bwd(block_k, stages):
            return backward_shared_memory(latent, rope, itemsize, tables, block_k, stages, scaled)

        block_k, stages = _fit(min(self.block_k, cap), self.num_stages, fwd, limit, "forward", dtype, heads,
                               latent + rope, tables)
        bwd_k, bwd_stages = _fit(min(self.bwd_block_k, cap), self.bwd_num_stages, bwd, limit, "backward", dtype,
                                 heads, latent + rope, tables)
        return dataclasses.replace(self, block_k=block_k, num_stages=stages, bwd_block_k=bwd_k,
                                   bwd_num_stages=bwd_stages)


# sm_90's shared memory per block with opt-in (`shared_memory_per_block_optin` of kernels/targets/*.txtpb: H20,
# H200; the H100 has the same). Triton asks for the opt-in amount; a kernel over it does not launch.
SHARED_MEMORY_PER_BLOCK = 232_448
# Barriers, the slot codes and reduction scratch beside the tiles: 256-768 B in the compiles measured, 4,416 B at most.
_SCRATCH = 4096


def forward_shared_memory(heads: int, latent: int, rope: int, itemsize: int, tables: int, block_k: int,
                          stages: int, scaled: int = 0) -> int:
    """Bytes of shared memory per block the forward may use: the query tiles [heads, C + R] and, per gathered
    [block_k, C + R] tile, one operand buffer plus `stages - 1` pipelined loads per table. An upper bound: sm_90a
    compiles (benchmarks/results/sparse_mla_compile_stats.json) used 221,440 B for this bound's 225,280 (bf16,
    64 heads, C 512, R 64, 64 slots, 2 stages); Triton's pipeliner may buffer fewer (3 stages: 2 buffers).
    `scaled` of the tables hold e4m3 c_kv rows: their pipelined loads are 1-byte [block_k, C] rows and [block_k]
    float32 scales (the operand buffer holds the dequantized rows, `itemsize`): bf16, two tables, one scaled, 32
    slots, 2 stages used 168,448 B for this bound's 172,160 (the same tiles on bf16 tables: 184,704)."""
    return ((heads + (tables * (stages - 1) + 1) * block_k) * (latent + rope) * itemsize + _SCRATCH
            - _scaled_saving(latent, itemsize, scaled, block_k, stages))


def _scaled_saving(latent: int, itemsize: int, scaled: int, block_k: int, stages: int) -> int:
    """Pipelined-load bytes `scaled` e4m3 tables save on `itemsize` rows: C x (itemsize - 1) less, 4 (a scale) more
    per row."""
    return scaled * (stages - 1) * block_k * (latent * (itemsize - 1) - 4)


def backward_shared_memory(latent: int, rope: int, itemsize: int, tables: int, block_k: int, stages: int,
                           scaled: int = 0) -> int:
    """Bytes of shared memory per block the backward may use: per slot of a step, its float32 key-row gradient
    staged for the store and the gathered row in both MMA layouts ((C + R) x (4 + 2 x itemsize)), plus `stages - 1`
    pipelined loads per table. The head block's query tiles stay in registers (compiles at 16 and 32 heads used
    the same bytes). An upper bound: bf16, C 512, R 64, 32 slots used 135,168 B for this bound's 151,552.
    `scaled` e4m3 tables (as in `forward_shared_memory`) add, per slot of a step, their [C] row staged once more in
    e4m3 and in `itemsize` (C x (1 + itemsize)): bf16, two tables, one scaled, 32 slots used 184,320 B (the same
    kernel on bf16 tables 135,168) for this bound's 200,704 (sm_90a; tests/kernels/test_sparse_mla_tiles.py)."""
    width = latent + rope
    return (block_k * width * (4 + 2 * itemsize) + tables * (stages - 1) * block_k * width * itemsize + _SCRATCH
            + scaled * block_k * latent * (1 + itemsize) - _scaled_saving(latent, itemsize, scaled, block_k, stages))


def _fit(block_k: int, stages: int, need, limit: int, kernel: str, dtype, heads: int, width: int,
         tables: int) -> tuple[int, int]:
    """The largest (step, stages) within `limit`: stages kept (>= 2 preferred) while a step >= 16 fits."""
    for try_stages in dict.fromkeys((stages, min(stages, 2), 1)):
        step = block_k
        while step >= 16:
            if need(step, try_stages) <= limit:
                return step, try_stages
            step //= 2
    raise ValueError(f"sparse MLA kernel: no {kernel} tile fits {limit:,} B of shared memory for {heads} heads x "
                     f"{width} wide {jnp.dtype(dtype).name} rows from {tables} table(s) (even 16 slots, one stage "
                     f"needs {need(16, 1):,} B); use kernels='reference'")


# Measured on an H200 (benchmarks/kernels_gpu.py --tune, bf16, 64 heads, k 2048): forward 64-slot steps with 8
# warps and 2 stages was the fastest of the six tried; backward 32 slots x 32 heads with 8 warps.
DEFAULT_CONFIG = KernelConfig()


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def _splits(num_queries: int, num_blocks: int, min_programs: int) -> int:
    """Programs per query: a power of two that brings the grid near `min_programs`, at most one per block."""
    want = -(-min_programs // max(num_queries, 1))
    return min(_pow2_at_least(want, 1), 1 << (max(num_blocks, 1).bit_length() - 1))


@dataclasses.dataclass(frozen=True)
class _Plan:
    heads: int  # real heads
    padded_heads: int
    slots: int  # real K
    padded_slots: int
    splits: int
    bwd_splits: int


def _plan(n: int, heads: int, slots: int, cfg: KernelConfig) -> _Plan:
    blocks = -(-slots // cfg.block_k)
    splits = _splits(n, blocks, cfg.min_programs)
    bwd_splits = _splits(n, -(-slots // cfg.bwd_block_k), cfg.min_programs)
    unit = math.lcm(cfg.block_k * splits, cfg.bwd_block_k * bwd_splits)
    return _Plan(heads, _pow2_at_least(heads, 16), slots, -(-slots // unit) * unit, splits, bwd_splits)


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def supported_widths(latent: int, rope: int) -> str | None:
    """Why the kernels cannot take these widths (Triton tiles are powers of two, MMA operands >= 16), or None."""
    for what, width in (("latent", latent), ("rope", rope)):
        if width < 16 or width & (width - 1):
            return f"sparse MLA kernel: the {what} width {width} is not a power of two >= 16"
    return None


def encode_rows(rows: jax.Array, valid: jax.Array) -> jax.Array:
    """rows: [..., K] absolute row per slot (masked slots: the row index 0 maps to); valid: [..., K] bool
    -> int32 codes (see `sparse_mla_kernels`)."""
    rows = rows.astype(jnp.int32)
    return jnp.where(valid, rows, -rows - 1)


def _prepare(q_lat, q_rope, codes, plan: _Plan):
    """Flatten queries to N and pad heads / slots: ([N,Hp,C], [N,Hp,R], [N,Kp])."""
    b, s, h, c = q_lat.shape
    n = b * s
    ql = _pad_axis(q_lat.reshape(n, h, c), 1, plan.padded_heads)
    qr = _pad_axis(q_rope.reshape(n, h, -1), 1, plan.padded_heads)
    codes = codes.reshape(n, -1)
    extra = plan.padded_slots - plan.slots
    if extra:
        # Padding slots repeat slot 0's row as masked: weight 0, or (for a fully masked query) one more
        # copy of the row the query averages, which leaves the average unchanged.
        first = codes[:, :1]
        pad = jnp.broadcast_to(jnp.where(first >= 0, -first - 1, first), (n, extra))
        codes = jnp.concatenate([codes, pad], axis=1)
    return ql, qr, codes


def _forward(q_lat, q_rope, kv_tables, kr_tables, kv_scales, codes, scale, interpret, cfg):
    b, s, h, c = q_lat.shape
    plan = _plan(b * s, h, codes.shape[-1], cfg)
    ql, qr, flat_codes = _prepare(q_lat, q_rope, codes, plan)
    o, m, l = kern.forward(flat_codes, ql, qr, kv_tables, kr_tables, kv_scales=kv_scales, scale=scale,
                           block_k=cfg.block_k,
                           splits=plan.splits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                           interpret=interpret, out_dtype=q_lat.dtype if plan.splits == 1 else jnp.float32)
    if plan.splits == 1:
        o, m, l = o[:, 0], m[:, 0], l[:, 0]
    else:  # log-sum-exp combine of the slot splits
        m_all = jnp.max(m, axis=1)
        weight = jnp.exp(m - m_all[:, None]) * l  # [N, splits, Hp]
        l_all = jnp.sum(weight, axis=1)
        o = (jnp.einsum("nsh,nshc->nhc", weight, o) / l_all[..., None]).astype(q_lat.dtype)
        m, l = m_all, l_all
    out = o[:, :h].reshape(b, s, h, c)
    lse = (m + jnp.log(l))[:, :h].reshape(b, s, h)
    return (out, lse), (ql, qr, flat_codes, o, m, l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _sparse_mla(q_lat, q_rope, kv_tables, kr_tables, kv_scales, codes, scale, interpret, cfg):
    return _forward(q_lat, q_rope, kv_tables, kr_tables, kv_scales, codes, scale, interpret, cfg)[0]


def _sparse_mla_fwd(q_lat, q_rope, kv_tables, kr_tables, kv_scales, codes, scale, interpret, cfg):
    outs, (ql, qr, flat_codes, o, m, l) = _forward(q_lat, q_rope, kv_tables, kr_tables, kv_scales, codes, scale,
                                                   interpret, cfg)
    return outs, (ql, qr, kv_tables, kr_tables, kv_scales, flat_codes, o, m, l, q_lat.shape, codes.shape)


def _chunked(x: jax.Array, chunks: int) -> jax.Array:
    """[N*, ...] -> [chunks, N*/chunks, ...] after zero-padding N to a multiple of `chunks`."""
    size = -(-x.shape[0] // chunks)
    return _pad_axis(x, 0, size * chunks).reshape(chunks, size, *x.shape[1:])


def _partials(rows: jax.Array) -> jax.Array:
    """Per-slot rows `[P, N, K, W]` (P head blocks) -> `[P, N*K, W]`, entries in (query, slot) order."""
    parts, n, k, w = rows.shape
    return rows.reshape(parts, n * k, w)


def _scatter_rows(acc_tables, rows_per_table, src, keys_sorted, ends, order, cfg, interpret):
    """Add per-entry rows `src: [P, E, W]` (summed over P) into `acc_tables` (rows of [A; B], `rows_per_table`
    rows each; an entry None: a table with no gradient, skipped), in key order."""
    out, offset = [], 0
    for acc, rows in zip(acc_tables, rows_per_table, strict=True):
        out.append(None if acc is None else kern.segment_sum(keys_sorted - offset, ends, order, src, acc,
                                                             block_e=cfg.segment_block, interpret=interpret))
        offset += rows
    return tuple(out)


def _sparse_mla_bwd(scale, interpret, cfg, residuals, cotangents):
    ql, qr, kv_tables, kr_tables, kv_scales, codes, o, m, l, q_shape, codes_shape = residuals
    d_out, d_lse = cotangents
    b, s, h, c = q_shape
    n, kp = codes.shape
    plan = _plan(n, h, codes_shape[-1], cfg)
    hp = plan.padded_heads
    do = _pad_axis(d_out.reshape(n, h, c), 1, hp).astype(ql.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    delta = delta - _pad_axis(d_lse.reshape(n, h).astype(jnp.float32), 1, hp)

    chunks = max(1, -(-n * kp // cfg.chunk_entries))
    per_chunk = -(-n // chunks)
    real = _chunked(jnp.ones((n,), bool), chunks)
    xs = tuple(_chunked(x, chunks) for x in (codes, ql, qr, do, m, l, delta)) + (real,)
    table_rows = tuple(t.shape[0] for t in kv_tables)
    total_rows = sum(table_rows)
    # A table with scales (e4m3 cache rows) is a constant: no accumulator, no scatter, a symbolic zero gradient
    # (the FP8 cache is never differentiated; its k_rope rows are not either). The other table's rows still are.
    frozen = tuple(s is not None for s in (kv_scales or (None,) * len(kv_tables)))

    def one_chunk(acc, args):
        codes_c, ql_c, qr_c, do_c, m_c, l_c, delta_c, real_c = args
        dql, dqr, dkv, dkr = kern.backward(codes_c, ql_c, qr_c, do_c, m_c, l_c, delta_c, kv_tables, kr_tables,
                                           kv_scales=kv_scales, scale=scale, block_k=cfg.bwd_block_k,
                                           block_h=min(cfg.bwd_block_h, hp), splits=plan.bwd_splits,
                                           num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages,
                                           interpret=interpret)
        valid, rows = kern.decode_rows(codes_c)
        # Masked slots carry weight 0 except in a fully masked query (each holds 1/K of its average).
        keep = (valid | ~jnp.any(valid, axis=1, keepdims=True)) & real_c[:, None]
        keys = jnp.where(keep, rows, total_rows).reshape(-1)
        order = jnp.argsort(keys, stable=True).astype(jnp.int32)
        keys_sorted = keys[order]
        ends = jnp.searchsorted(keys_sorted, keys_sorted, side="right").astype(jnp.int32)
        acc_kv, acc_kr = acc
        acc_kv = _scatter_rows(acc_kv, table_rows, _partials(dkv), keys_sorted, ends, order, cfg, interpret)
        acc_kr = _scatter_rows(acc_kr, table_rows, _partials(dkr), keys_sorted, ends, order, cfg, interpret)
        return (acc_kv, acc_kr), (jnp.sum(dql, axis=1), jnp.sum(dqr, axis=1))

    zeros = tuple(tuple(None if off else jnp.zeros(t.shape, jnp.float32) for t, off in zip(tables, frozen,
                                                                                         strict=True))
                  for tables in (kv_tables, kr_tables))
    (acc_kv, acc_kr), (dql, dqr) = jax.lax.scan(one_chunk, zeros, xs)
    dql = dql.reshape(chunks * per_chunk, hp, -1)[:n, :h]
    dqr = dqr.reshape(chunks * per_chunk, hp, -1)[:n, :h]
    d_kv = tuple(None if a is None else a.astype(t.dtype) for a, t in zip(acc_kv, kv_tables, strict=True))
    d_kr = tuple(None if a is None else a.astype(t.dtype) for a, t in zip(acc_kr, kr_tables, strict=True))
    d_scales = None if kv_scales is None else (None,) * len(kv_scales)
    return (dql.reshape(q_shape).astype(ql.dtype), dqr.reshape(*q_shape[:3], -1).astype(qr.dtype), d_kv, d_kr,
            d_scales, None)


_sparse_mla.defvjp(_sparse_mla_fwd, _sparse_mla_bwd)


def sparse_mla_tables(q_lat: jax.Array, q_rope: jax.Array, kv_tables: tuple, kr_tables: tuple, codes: jax.Array, *,
                      scale: float, interpret: bool = False, config: KernelConfig = DEFAULT_CONFIG,
                      kv_scales: tuple | None = None):
    """Sparse MLA over rows of one or two tables.

    q_lat: [B,S,H,C], q_rope: [B,S,H,R]; kv_tables: ([Ra,C],) or ([Ra,C], [Rb,C]); kr_tables likewise with
    R; codes: [B,S,K] int32 from `encode_rows` (rows of [A; B]). kv_scales: None, or per kv table None or the
    float32 scales [Ra] of its e4m3 rows (an FP8 cache, `model/cache_fp8.py`): the kernels dequantize each
    selected row as `cache_fp8.read_rows` does (value x scale in float32, rounded once to q_lat's dtype).
    Returns (latent output [B,S,H,C] in q_lat's dtype, log-sum-exp of the scaled logits [B,S,H] float32).
    Differentiable in q and the tables, except a scaled table and its k_rope table: constants (an FP8 cache is
    never differentiated), their gradient a symbolic zero.
    """
    problem = supported_widths(q_lat.shape[-1], q_rope.shape[-1])
    if problem is not None:
        raise ValueError(problem)
    if len(kv_tables) not in (1, 2) or len(kv_tables) != len(kr_tables):
        raise ValueError("sparse MLA kernel: one or two row tables, the same number for c_kv and k_rope")
    kv_scales = _check_scales(kv_tables, kv_scales)
    scaled = sum(s is not None for s in kv_scales or ())
    return _sparse_mla(q_lat, q_rope, tuple(kv_tables), tuple(kr_tables), kv_scales, codes.astype(jnp.int32),
                       float(scale), bool(interpret), config.for_dtype(q_lat.dtype).fitted(
                           q_lat.dtype, len(kv_tables), _pow2_at_least(q_lat.shape[2], 16), q_lat.shape[-1],
                           q_rope.shape[-1], codes.shape[-1], scaled=scaled))


def _check_scales(kv_tables: tuple, kv_scales) -> tuple | None:
    """`kv_scales` as a tuple aligned with `kv_tables` (None: no table has scales), or one line naming the problem."""
    if kv_scales is None or all(s is None for s in kv_scales):
        return None
    if len(kv_scales) != len(kv_tables):
        raise ValueError(f"sparse MLA kernel: kv_scales has {len(kv_scales)} entries for {len(kv_tables)} kv "
                         "table(s); give one per table (None for a table without scales)")
    for n, (table, scales) in enumerate(zip(kv_tables, kv_scales, strict=True)):
        if scales is None:
            continue
        if jnp.dtype(table.dtype) != jnp.dtype(jnp.float8_e4m3fn) or scales.shape != table.shape[:1]:
            raise ValueError(f"sparse MLA kernel: kv table {n} with scales must be float8_e4m3fn rows [rows, C] "
                             f"with float32 scales [rows]; got {table.dtype} {table.shape} and scales "
                             f"{scales.shape}")
    return tuple(None if s is None else s.astype(jnp.float32) for s in kv_scales)
