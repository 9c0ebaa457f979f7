"""Routed experts on one device: the grouped SwiGLU (+ LoRA) and the dropless `experts_ragged`.

`grouped_swiglu` is the one expert computation behind both MoE paths: `experts_ragged` (this
device holds every expert) and `expert_parallel.experts_ep` (each device runs its local experts on
the rows it received). Rows arrive sorted by expert, so each expert's rows are contiguous and
`lax.ragged_dot` multiplies group g of `group_sizes` by kernel g. Rows past `sum(group_sizes)`
(EP padding) lie outside every group and come out as zeros.

LoRA reaches `grouped_swiglu` as plain arrays `(A [E,in,r], B [E,r,out], scale)`, not `Adapter`
modules, because the EP path calls it inside `jax.shard_map` on the local expert shards.

The functions that call `lax.ragged_dot` keep "ragged" in their names: the plan mode
(`plan.analyze_hlo`) counts a dot as ragged_dot FLOPs by the Python function XLA recorded for it.

Axis letters: T tokens, K experts per token, M rows (token-expert pairs), D model, I expert
intermediate, E experts, r LoRA rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from glm52_jax.kernels import use_pallas
from glm52_jax.kernels.grouped_matmul import (
    W8A8_BLOCK,
    grouped_matmul,
    grouped_matmul_fp8,
    grouped_matmul_w8a8,
    grouped_matmul_w8a8_rows,
    quantize_rows,
    supported,
    w8a8_supported,
)
from glm52_jax.model import fp8
from glm52_jax.model.lora import Adapter

LoRAArrays = tuple[jax.Array, jax.Array, float]  # (A [E,in,r], B [E,r,out], scale = alpha / r)
ExpertLoRA = tuple[LoRAArrays | None, LoRAArrays | None, LoRAArrays | None]  # (gate, up, down)
ExpertAdapters = tuple[Adapter | None, Adapter | None, Adapter | None]  # (gate, up, down)


def lora_arrays(adapters: Sequence[Adapter | None] | None) -> ExpertLoRA | None:
    """The routed-expert `Adapter`s (gate, up, down) as `LoRAArrays` (None stays None)."""
    if adapters is None:
        return None
    return tuple(None if ad is None else (ad.a[...], ad.b[...], ad.scale) for ad in adapters)


def ragged_lora_delta(xs: jax.Array, lora: LoRAArrays, group_sizes: jax.Array) -> jax.Array:
    """Per-expert LoRA delta: `xs: [M,in]`, group_sizes [E] -> `scale * (xs A_g) B_g`: [M,out] float32.

    A and B are cast to the rows' dtype; both products accumulate in float32 and the rank-r
    intermediate is rounded to the rows' dtype in between.
    """
    a, b, scale = lora
    t = jax.lax.ragged_dot(xs, a.astype(xs.dtype), group_sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(t.astype(xs.dtype), b.astype(xs.dtype), group_sizes, preferred_element_type=jnp.float32)
    return y * scale


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """`group_sizes: [E]` -> `[M]` int32: each row's group (E for rows past `sum(group_sizes)`)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def blockdiag_lora_delta(xs: jax.Array, lora: LoRAArrays, group_sizes: jax.Array) -> jax.Array:
    """`ragged_lora_delta` as two dense matmuls: every row against all E adapters' A (`[M, E, r]`, small
    for rank r), the other experts' entries zeroed, then against B stacked `[E*r, out]`.

    Same rounding as `ragged_lora_delta` (float32 accumulation, the rank-r product rounded to the rows'
    dtype). Used beside the grouped-matmul kernel: XLA:GPU would lower the rank-r `ragged_dot`s densely.
    """
    a, b, scale = lora
    experts, _, rank = a.shape
    t = jnp.einsum("mi,eir->mer", xs, a.astype(xs.dtype), preferred_element_type=jnp.float32)
    own = row_groups(group_sizes, xs.shape[0])[:, None] == jnp.arange(experts, dtype=jnp.int32)[None, :]
    t = jnp.where(own[:, :, None], t, 0.0).astype(xs.dtype).reshape(xs.shape[0], experts * rank)
    y = jnp.einsum("mk,ko->mo", t, b.astype(xs.dtype).reshape(experts * rank, -1), preferred_element_type=jnp.float32)
    return y * scale


@functools.partial(jax.tree_util.register_dataclass, data_fields=("values", "scales"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """Rows quantized for the FP8 experts (`quantize_rows`): values [M, K] float8_e4m3fn, scales [M, ceil(K / 128)]
    float32. The expert-parallel exchange sends them so (`expert_parallel`), rather than quantizing at the expert."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def to_bytes(self) -> jax.Array:
        """The rows as one uint8 array `[M, K + 4 * ceil(K / 128)]` (values, then the scales' bytes): what travels."""
        scales = jax.lax.bitcast_convert_type(self.scales, jnp.uint8).reshape(self.scales.shape[0], -1)
        return jnp.concatenate([jax.lax.bitcast_convert_type(self.values, jnp.uint8), scales], axis=-1)

    @classmethod
    def from_bytes(cls, packed: jax.Array, width: int) -> Fp8Rows:
        """Inverse of `to_bytes` for rows of `width` K."""
        blocks = -(-width // W8A8_BLOCK)
        values = jax.lax.bitcast_convert_type(packed[:, :width], jnp.float8_e4m3fn)
        scales = jax.lax.bitcast_convert_type(packed[:, width:width + 4 * blocks].reshape(-1, blocks, 4), jnp.float32)
        return cls(values, scales)

    def dequantized(self, dtype) -> jax.Array:
        """`value x scale` in float32, rounded once to `dtype`: what the LoRA deltas of FP8 experts multiply."""
        full = jnp.repeat(self.scales, W8A8_BLOCK, axis=1)[:, :self.values.shape[1]]
        return (self.values.astype(jnp.float32) * full).astype(dtype)


def fp8_rows(xs: jax.Array) -> Fp8Rows:
    """`xs: [M, K]` quantized as FP8 experts take it (no gradient: `_straight_through` carries it)."""
    return Fp8Rows(*quantize_rows(jax.lax.stop_gradient(xs)))


@jax.custom_vjp
def _straight_through(x: jax.Array, quantized: jax.Array) -> jax.Array:
    """`quantized` (x's quantized value) forward, the identity's gradient to `x` backward."""
    return quantized


_straight_through.defvjp(lambda x, q: (q, None), lambda _, ct: (ct, jnp.zeros_like(ct)))


def ragged_w8a8(rows32: jax.Array, w: fp8.Fp8Weight, group_sizes: jax.Array) -> jax.Array:
    """`grouped_matmul_w8a8`'s numbers on `lax.ragged_dot` (any K, N, block): FP8 rows, dequantized in float32
    (`rows32: [M,in]`, `Fp8Rows.dequantized`), times each row's expert kernel dequantized in float32 -> [M,out]
    float32. Equal to the kernel's up to float32 rounding (the kernel scales each 128-long block's sum; here the
    products are of scaled values)."""
    w32 = fp8.dense(fp8.Fp8Weight(w.values, w.scales, w.block, jnp.dtype(jnp.float32)))
    return jax.lax.ragged_dot(rows32, w32, group_sizes, preferred_element_type=jnp.float32,
                              precision=jax.lax.Precision.HIGHEST)


def _w8a8(xs: jax.Array | Fp8Rows, w: fp8.Fp8MmaWeight, group_sizes: jax.Array, kernel: bool, rows_hint):
    """FP8 rows (`xs` quantized here, or already `Fp8Rows`) times FP8 expert kernels -> (out [M,out] float32, the
    rows as the LoRA delta takes them: dequantized, in the weights' dtype). On the kernel where its shapes suit it,
    else `ragged_w8a8`. Gradients to float `xs` pass straight through the quantization (both outputs); `Fp8Rows`
    get none (the exchange that sends them is differentiated as the float rows' exchange: `expert_parallel`)."""
    dtype = w.dtype
    fast = kernel and w8a8_supported(w.shape[-2], w.shape[-1], w.block)
    if isinstance(xs, Fp8Rows):
        out = (grouped_matmul_w8a8_rows(xs.values, xs.scales, w.values, w.scales, group_sizes, rows_hint=rows_hint)
               if fast else ragged_w8a8(xs.dequantized(jnp.float32), w, group_sizes))
        return out, xs.dequantized(dtype)
    rows = fp8_rows(xs)
    if fast:  # its own straight-through VJP (the dequantized kernel, transposed); the rows quantized once, here
        out = grouped_matmul_w8a8(xs, w.values, w.scales, w.block, group_sizes, rows_hint=rows_hint,
                                  quantized=(rows.values, rows.scales))
    else:
        out = ragged_w8a8(_straight_through(xs.astype(jnp.float32), rows.dequantized(jnp.float32)), w, group_sizes)
    return out, _straight_through(xs, rows.dequantized(dtype).astype(xs.dtype))


def _ragged(xs: jax.Array | Fp8Rows, w: jax.Array | fp8.Fp8Weight, group_sizes: jax.Array,
            lora: LoRAArrays | None, kernel: bool = False, rows_hint: int | None = None) -> jax.Array:
    """`xs: [M,in]` times each row's expert kernel `w: [E,in,out]` (+ LoRA) -> [M,out] float32.

    kernel: use the grouped-matmul kernel (`kernels.grouped_matmul`, told `rows_hint`; an FP8 `w` dequantized
    inside it, block by block) and the block-diagonal LoRA. Otherwise `w` is an array (`fp8.dense`'s). An
    `fp8.Fp8MmaWeight` multiplies FP8 rows (w8a8, `_w8a8`), and its LoRA delta takes those rows dequantized."""
    lora_in = xs
    if isinstance(w, fp8.Fp8MmaWeight):
        out, lora_in = _w8a8(xs, w, group_sizes, kernel, rows_hint)
    elif kernel and isinstance(w, fp8.Fp8Weight):
        out = grouped_matmul_fp8(xs, w.values, w.scales, w.block, group_sizes, rows_hint=rows_hint)
    elif kernel:
        out = grouped_matmul(xs, w, group_sizes, rows_hint=rows_hint)
    else:
        out = jax.lax.ragged_dot(xs, w, group_sizes, preferred_element_type=jnp.float32)
    if lora is None:
        return out
    return out + (blockdiag_lora_delta if kernel else ragged_lora_delta)(lora_in, lora, group_sizes)


def grouped_swiglu(xs_sorted: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, lora: ExpertLoRA | None = None, kernels: str = "reference",
                   rows_hint: int | None = None) -> jax.Array:
    """`down(silu(gate(x)) * up(x))` of each row with its expert's kernels -> [M,D] float32.

    xs_sorted: [M,D], rows grouped by expert in expert order (cast to the kernels' dtype);
    group_sizes: [E] int32, rows per expert (sum <= M); w_gate, w_up: [E,D,I]; w_down: [E,I,D];
    lora: None, or (gate, up, down), each None or `LoRAArrays`. The SwiGLU product is rounded to
    w_down's dtype before the down projection. kernels: a `ModelOptions.kernels` value; where it selects
    the Pallas kernels (and the shapes suit it) the matmuls run on the grouped-matmul kernel; rows_hint:
    the rows expected to be in groups (default M; plan mode's FLOP count of the kernel). A kernel may be an
    `fp8.Fp8Weight` ([E,...] e4m3 + per-expert block scales), computing in its parameter dtype: on the
    grouped-matmul kernel each block is dequantized as it is loaded (no dequantized copy of the experts in
    HBM: benchmarks/fp8_matmul_aot.py); on `lax.ragged_dot` the experts this call holds are dequantized first. An
    `fp8.Fp8MmaWeight` (`model.expert_dtype="fp8"`) multiplies the rows quantized to e4m3 (w8a8, `_ragged`).
    """
    lora_gate, lora_up, lora_down = lora or (None, None, None)
    xs = xs_sorted if isinstance(xs_sorted, Fp8Rows) else xs_sorted.astype(w_gate.dtype)
    kernel = (use_pallas(kernels) and supported(xs.shape, w_gate.shape, w_gate.dtype)
              and supported(xs.shape, w_down.shape, w_down.dtype))
    if not kernel:  # FP8 MMA weights stay quantized (`ragged_w8a8`)
        w_gate, w_up, w_down = (w if isinstance(w, fp8.Fp8MmaWeight) else fp8.dense(w) for w in (w_gate, w_up, w_down))
    gate = _ragged(xs, w_gate, group_sizes, lora_gate, kernel, rows_hint)
    up = _ragged(xs, w_up, group_sizes, lora_up, kernel, rows_hint)
    h = (jax.nn.silu(gate) * up).astype(w_down.dtype)
    return _ragged(h, w_down, group_sizes, lora_down, kernel, rows_hint)


def experts_ragged(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, lora: ExpertAdapters | None = None, kernels: str = "reference") -> jax.Array:
    """Dropless routed experts: `x: [T,D], weights/experts: [T,K]`, `w_*: [E,D,I] / [E,I,D]` -> [T,D] float32.

    Token-expert pairs are sorted by expert and run through `grouped_swiglu`, so memory is
    `O(T * K * D)` whatever the routing. `lora`: None, or the (gate, up, down) routed-expert
    adapters (A [E,in,r], B [E,r,out]). kernels: as in `grouped_swiglu`.
    """
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    y = grouped_swiglu(x[token_of], group_sizes, w_gate, w_up, w_down, lora_arrays(lora), kernels)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(y)
