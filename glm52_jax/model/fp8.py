"""FP8 base weights: float8_e4m3fn values with one float32 scale per block, dequantized where they are used.

An HF FP8 checkpoint (the DeepSeek-V3 / GLM-5 FP8 convention) stores a linear weight `W [out, in]` as e4m3
values plus `weight_scale_inv [ceil(out/b0), ceil(in/b1)]` float32: each element is its e4m3 value times the
scale of its b0 x b1 block (a partial last block has its own scale). `checkpoint.hf_fp8` puts both into our
layout: an `Fp8Weight` holds the values in the weight's own layout and shape (stacked on 'layers', experts
first) and the scales on a grid of `block` elements per trailing dim (leading dims, layers and experts, have
blocks of 1), so each scale still covers exactly the elements of one HF block.

A model's `nnx.Param` then holds an `Fp8Weight` instead of an array: one byte per element on device (half of
bf16), gathered and sharded like the array it stands for (the values like the weight, the scales by the
weight's logical axes on the dims of equal size and whole on the blocked ones: `parallel.placement`). It is
dequantized inside the jitted program that uses it (`dense`, called by `layers.project` and
`grouped_mlp.grouped_swiglu`), on whatever part the program holds there: the all-gathered weight, a
few-token call's local FSDP shard, an expert-parallel device's own experts. The reference path: one
elementwise `value x scale` (XLA fuses the scale expansion into it), then the usual matmul in `dtype`.

The base is frozen: `dense` stops gradients, so only the LoRA adapters (bf16/fp32, as always) get any.

`quantize` makes an `Fp8Weight` from a plain weight by the same block rule the releases use (scale = the
block's amax / 448, e4m3's largest finite value; value = w / scale rounded to e4m3): how a random init becomes
an FP8 model (`model.base_weights="fp8"`; a float checkpoint is quantized in HF's layout as it is read,
`checkpoint.hf_fp8.quantize_hf`).

Axis letters: L leading (unblocked) dims, X blocked dims.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448: a block's largest |w| maps to it


@functools.partial(jax.tree_util.register_dataclass, data_fields=("values", "scales"),
                   meta_fields=("block", "dtype"))
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """values: [*L, *X] float8_e4m3fn; scales: [*L, *ceil(X / block)] float32; block: elements per scale on
    each of the trailing dims X; dtype: what `dense` returns (the weight's parameter dtype)."""

    values: Any
    scales: Any
    block: tuple[int, ...]
    dtype: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("values", "scales"),
                   meta_fields=("block", "dtype"))
@dataclasses.dataclass(frozen=True)
class Fp8MmaWeight(Fp8Weight):
    """An `Fp8Weight` multiplied on FP8 tensor cores (`model.expert_dtype="fp8"`, w8a8): the rows it multiplies are
    quantized to e4m3 too (`grouped_mlp`), rather than it being dequantized to `dtype`. `dense` still dequantizes
    it (it is an `Fp8Weight`)."""


def for_fp8_mma(weight, block: tuple[int, int] = (128, 128)) -> Fp8MmaWeight:
    """An expert stack `[E, in, out]` as an `Fp8MmaWeight` in `block`s of its last two dims: an FP8 base's values and
    scales as stored when its block is `block`, anything else quantized by `quantize` (a float weight by the
    releases' rule; an FP8 weight in other blocks dequantized first)."""
    if isinstance(weight, Fp8Weight) and tuple(weight.block) == tuple(block):
        return Fp8MmaWeight(weight.values, weight.scales, weight.block, weight.dtype)
    w = jax.lax.stop_gradient(dense(weight))  # frozen: only the LoRA adapters train
    q = quantize(w, block)
    return Fp8MmaWeight(q.values, q.scales, q.block, q.dtype)


def scale_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` with `block` on its trailing dims (a partial block counts)."""
    lead = len(shape) - len(block)
    return tuple(shape[:lead]) + tuple(math.ceil(n / b) for n, b in zip(shape[lead:], block, strict=True))


def expand_scales(scales: jax.Array, block: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    """`scales` repeated `block` times on the trailing dims and cut to `shape`: one scale per element."""
    lead = len(shape) - len(block)
    for axis, b in enumerate(block, start=lead):
        if b > 1:
            scales = jnp.repeat(scales, b, axis=axis)
        scales = jax.lax.slice_in_dim(scales, 0, shape[axis], axis=axis)
    return scales


def dense(weight):
    """The weight as an array of its parameter dtype: an `Fp8Weight` dequantized (no gradient flows to it),
    anything else unchanged. `value x scale` is one float32 product, rounded once to `dtype`."""
    if not isinstance(weight, Fp8Weight):
        return weight
    values, scales = jax.lax.stop_gradient((weight.values, weight.scales))
    full = expand_scales(scales.astype(jnp.float32), weight.block, weight.shape)
    return (values.astype(jnp.float32) * full).astype(weight.dtype)


def quantize(w: jax.Array, block: tuple[int, ...], dtype=None) -> Fp8Weight:
    """`w [*L, *X]` as an `Fp8Weight` with one scale per `block` of its trailing dims X (a partial last block has
    its own; leading dims L unblocked): scale = amax(|w| over the block) / 448 in float32 (1 for an all-zero
    block), value = w / scale rounded to nearest e4m3. `dtype`: what `dense` returns (default: w's dtype).
    XLA:CPU divides through a reciprocal, so a scale may be 1 ulp off IEEE division's (numpy's, which
    `hf_fp8.quantize_hf` uses to match a release bit for bit); for a random init that is immaterial."""
    shape, block = tuple(w.shape), tuple(block)
    lead = len(shape) - len(block)
    grid = scale_shape(shape, block)
    w32 = w.astype(jnp.float32)
    # |w| zero-padded to whole blocks (zeros never raise an amax), then [*L, g0, b0, g1, b1, ...]: max over the b's.
    padded = jnp.pad(jnp.abs(w32), [(0, 0)] * lead + [(0, g * b - n) for n, g, b in
                                                     zip(shape[lead:], grid[lead:], block)])
    tiles = padded.reshape(shape[:lead] + tuple(d for g, b in zip(grid[lead:], block) for d in (g, b)))
    amax = jnp.max(tiles, axis=tuple(lead + 2 * i + 1 for i in range(len(block))))
    scales = jnp.where(amax > 0, amax / jnp.float32(E4M3_MAX), jnp.float32(1.0))
    values = (w32 / expand_scales(scales, block, shape)).astype(E4M3)
    return Fp8Weight(values, scales, block, jnp.dtype(dtype or w.dtype))
