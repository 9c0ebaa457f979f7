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
