"""Test helpers for models with LoRA: fast-compiling init keys and adapters with nonzero B."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax.model.lora import LoRA


def fast_rngs() -> nnx.Rngs:
    """rbg keys: their random draws compile fast on XLA:CPU (eager init compiles every op once)."""
    return nnx.Rngs(jax.random.key(0, impl="rbg"), lora=jax.random.key(1, impl="rbg"))


def with_random_b(model, seed=0, std=0.05):
    """Every B random, so every family gets a gradient through every path."""
    graphdef, params, lora = nnx.split(model, nnx.Param, LoRA)
    rng = np.random.default_rng(seed)  # numpy: no per-shape XLA compiles
    flat = []
    for path, var in nnx.to_flat_state(lora):
        value = var.get_value()
        if path[-1] in ("b", "b_k", "b_v"):
            value = jnp.asarray(std * rng.standard_normal(value.shape), value.dtype)
        flat.append((path, var.replace(value)))
    return nnx.merge(graphdef, params, nnx.from_flat_state(flat))


def random_adapters(lora: nnx.State, seed=0, std=0.05) -> nnx.State:
    """Every A and B of an adapter state (real or abstract, e.g. from `nnx.eval_shape`) drawn at random: adapters
    for a loaded base without `attach_lora`'s compile of the model constructor."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(std * rng.standard_normal(a.shape), a.dtype), lora)
