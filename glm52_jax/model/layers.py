"""Small building blocks: named parameters, norms, projections, gathering FSDP-sharded weights (or, in a
few-token call, keeping them in place: `parallel.tensor_parallel`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax.model import fp8
from glm52_jax.parallel import tensor_parallel
from glm52_jax.parallel.rules import STACK_AXIS, Split, fsdp_split, gather_weight

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


def weight_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes of `var`'s value. Inside a layer scan `var` is one layer's slice of a stack whose axes
    still name 'layers' first."""
    value = var.get_value()
    axes = tuple(var.get_metadata().get("out_sharding") or (None,) * value.ndim)
    if len(axes) == value.ndim + 1 and axes[0] == STACK_AXIS:
        axes = axes[1:]
    return axes


def kept_split(var: nnx.Variable) -> Split | None:
    """Where a base weight stays FSDP-sharded in a few-token call (`tensor_parallel.enabled()`): its
    `rules.fsdp_split`, for matrices (rank >= 2); None (gathered as usual) otherwise. Vectors (norm scales,
    biases) are kilobytes and simply gathered. `project` and the embedding / unembedding use a kept weight
    tensor-parallel; other users of one (the MoE router, experts on a mesh where FSDP also splits them) get it
    sharded and GSPMD / their shard_map moves what they need."""
    value = var.get_value()
    if not tensor_parallel.enabled() or value.ndim < 2:
        return None
    return fsdp_split(weight_axes(var), value.shape)


def gathered_value(var: nnx.Variable) -> jax.Array | fp8.Fp8Weight:
    """A base weight's value at its logical sharding: its FSDP shards all-gathered (`rules.gather_weight`).
    An FP8 weight's e4m3 values travel (one byte per element); its scales are never FSDP-sharded."""
    value = var.get_value()
    if isinstance(value, fp8.Fp8Weight):
        return dataclasses.replace(value, values=gather_weight(value.values, weight_axes(var)))
    return gather_weight(value, weight_axes(var))


def gather_params(state: nnx.State) -> nnx.State:
    """`state` with every base weight (`nnx.Param`) gathered (`gathered_value`), except the ones a few-token
    call keeps in place (`kept_split`); LoRA and the rest as they are. The layer scan's body applies it to one
    layer's state: the per-layer, just-in-time FSDP all-gather."""
    return nnx.from_flat_state([
        (key, var.replace(gathered_value(var)) if isinstance(var, nnx.Param) and kept_split(var) is None else var)
        for key, var in nnx.to_flat_state(state)])


def gathered(module: nnx.Module) -> nnx.Module:
    """`module` (used inside a traced function) with its base weights gathered (`gather_params`)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, gather_params(state))


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
    float32 accumulator before the cast. A kernel a few-token call keeps FSDP-sharded (`kept_split`)
    is used tensor-parallel (`tensor_parallel.einsum`); the LoRA delta is computed on the whole x either
    way (adapters are not FSDP-sharded). An FP8 kernel (`fp8.Fp8Weight`) is dequantized here, elementwise on
    the part this program holds (a kept kernel: each device its own shard, so nothing more moves).
    """
    w = fp8.dense(kernel.get_value())
    x = x.astype(w.dtype)
    split = kept_split(kernel)
    if split is None:
        out = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    else:
        out = tensor_parallel.einsum(spec, x, w, split)
    if lora is not None:
        out = out + lora(x, spec)
    return out.astype(w.dtype)
