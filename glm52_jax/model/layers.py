"""Small building blocks: named parameters, norms, projections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Axes = tuple[str | None, ...]


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: Axes, dtype, *, init: str = "normal",
          std: float = 0.02) -> nnx.Param:
    """A parameter with logical axis names (used by `parallel.rules`, never sharded eagerly)."""
    if len(axes) != len(shape):
        raise ValueError(f"param: axes {axes} do not match shape {shape}")
    if init == "normal":
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        raise ValueError(f"param: unknown init {init!r}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """HF `GlmMoeDsaRMSNorm`: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, axis_name: str, dtype):
        self.eps = eps
        self.weight = param(None, (dim,), (axis_name,), dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch `nn.LayerNorm` (weight and bias), computed in float32."""

    def __init__(self, dim: int, eps: float, axis_name: str, dtype):
        self.eps = eps
        self.weight = param(None, (dim,), (axis_name,), dtype, init="ones")
        self.bias = param(None, (dim,), (axis_name,), dtype, init="zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def project(x: jax.Array, kernel: nnx.Param, spec: str, lora=None) -> jax.Array:
    """`einsum(spec, x, kernel)` in the kernel's dtype with float32 accumulation.

    `lora`: None, or a callable `(x, spec) -> float32 delta` (a `lora.Adapter`), added to the
    float32 accumulator before the cast.
    """
    w = kernel[...]
    x = x.astype(w.dtype)
    out = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    if lora is not None:
        out = out + lora(x, spec)
    return out.astype(w.dtype)
