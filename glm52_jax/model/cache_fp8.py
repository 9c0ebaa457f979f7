"""FP8 cache rows (`ModelOptions.cache_dtype="float8_e4m3fn"`): what the decode / prefix cache stores of the
MLA latent `c_kv` and the indexer key, and how a reader turns selected rows back into numbers.

One float32 scale per cached row (one token slot of one layer): scale = amax|row| / 448 (e4m3's largest
finite value), stored value = round_to_e4m3(row / scale); an all-zero row gets scale 1 (as do the unwritten
slots of an empty cache). `k_rope` is not quantized: it carries the positions, and DeepSeek-V3.2's FP8 cache
keeps its RoPE part in bf16 too. Values are 1 byte instead of the model dtype's 2 (bf16) or 4; a scale adds
4 bytes per row (C = 512: ~0.8% of the latent's e4m3 bytes).

Readers never dequantize a whole cache (at 2M tokens that copy is what the format saves): the indexer
dequantizes one key block inside its streaming loop (or the Pallas kernel applies the per-key scale to
each key's score), attention gathers its top-k rows and their scales and dequantizes only those.

Axis letters: X the row's features (C or I); leading axes are any cache stack's ([reps, U|F, B, Cap]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm52_jax.choices import CACHE_DTYPES
from glm52_jax.kernels.indexer import quantize_e4m3

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def check_cache_dtype(cache_dtype: str) -> str:
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype: expected one of {CACHE_DTYPES}, got {cache_dtype!r}")
    return cache_dtype


def quantized(cache_dtype: str) -> bool:
    """Whether `cache_dtype` (a `CACHE_DTYPES` name) stores e4m3 rows with scales ("auto": the model dtype)."""
    return check_cache_dtype(cache_dtype) != "auto"


def values_dtype(cache_dtype: str, dtype) -> jnp.dtype:
    """The dtype of the cached latent and indexer-key values: e4m3, or the model's `dtype` for "auto"."""
    return E4M3 if quantized(cache_dtype) else jnp.dtype(dtype)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x: [..., X] -> (values [..., X] e4m3, scales [...] float32)`, one scale per row (the rule above; the
    indexer kernel's FP8 quantisation, `kernels.indexer.quantize_e4m3`, is this very rule)."""
    return quantize_e4m3(x)


def store_rows(chunks, quantize: bool) -> tuple[list, list]:
    """The per-segment chunk entries `[reps, U|F, B, S, X]` as a cache stores them: (values, scales), with
    `quantize`; else (the entries unchanged, []). Gradient-free: a quantized cache holds constants."""
    if not quantize:
        return list(chunks), []
    pairs = [quantize_rows(jax.lax.stop_gradient(c)) for c in chunks]
    return [v for v, _ in pairs], [s for _, s in pairs]


def read_rows(values: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """Rows as numbers of `dtype`: `values [..., X] x scales [...]` (one float32 product, rounded once to
    `dtype`) for quantized rows; without scales, the values cast to `dtype`."""
    if scales is None:
        return values.astype(dtype)
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)
