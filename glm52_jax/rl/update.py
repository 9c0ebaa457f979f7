"""One GRPO update: G per-sample backwards (a gradient mode), accumulation, one AdamW step on LoRA.

Only the `LoRA` variables are trained; the base (`nnx.Param`) is never touched. A non-finite loss or
gradient aborts the step before anything changes: `NonFiniteGradientError` names the first
offending adapter, and params and optimizer state stay byte-identical.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glm52_jax.model.kv_cache import KVCache
from glm52_jax.model.lora import LoRA
from glm52_jax.rl.gradients import LossSettings, lora_gradients


class NonFiniteGradientError(FloatingPointError):
    """The step's loss or a LoRA gradient holds NaN/Inf; nothing was updated."""


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """AdamW on the adapters, after clipping the gradient to `max_grad_norm` (global L2)."""

    learning_rate: float = 1e-5
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0

    def transform(self) -> optax.GradientTransformation:
        adamw = optax.adamw(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        if self.max_grad_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw)


def _pure(state: nnx.State) -> nnx.State:
    """The state with raw arrays as leaves (what optax sees)."""
    return nnx.as_pure(state)


@functools.partial(jax.jit, static_argnums=0)
def _apply(tx: optax.GradientTransformation, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@jax.jit
def _finite_flags(grads, loss):
    return jax.tree.map(lambda g: jnp.all(jnp.isfinite(g)), grads), jnp.isfinite(loss)


class LoRAOptimizer:
    """AdamW state for a model's LoRA adapters; `step` counts applied updates."""

    def __init__(self, model: nnx.Module, config: AdamWConfig = AdamWConfig()):
        self.config = config
        self.tx = config.transform()
        params = _pure(nnx.state(model, LoRA))
        if not jax.tree.leaves(params):
            raise ValueError("LoRAOptimizer: the model has no LoRA adapters to train")
        self.opt_state = self.tx.init(params)
        self.step = 0

    def apply(self, model: nnx.Module, grads: nnx.State, loss: jax.Array | None = None) -> None:
        """One optimizer step with `grads` (LoRA-shaped); aborts, unchanged, on non-finite input."""
        grads = _pure(grads)
        check_finite(grads, jnp.zeros(()) if loss is None else loss)
        params, self.opt_state = _apply(self.tx, _pure(nnx.state(model, LoRA)), self.opt_state, grads)
        nnx.update(model, params)
        self.step += 1


def check_finite(grads: nnx.State, loss: jax.Array) -> None:
    """Raises `NonFiniteGradientError` naming the first non-finite gradient leaf (or the loss)."""
    flags, loss_ok = jax.device_get(_finite_flags(grads, loss))
    bad = [path for path, ok in nnx.to_flat_state(flags) if not bool(ok)]
    if bad:
        names = ", ".join("/".join(map(str, p)) for p in bad[:3])
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise NonFiniteGradientError(f"non-finite gradient for LoRA parameter {names}{more}; step aborted, "
                                     "parameters and optimizer state unchanged")
    if not bool(loss_ok):
        raise NonFiniteGradientError("non-finite loss; step aborted, parameters and optimizer state unchanged")


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """loss []: batch GRPO loss; grad_norm []: global L2 norm before clipping; logprobs [G,R];
    metrics: `grpo.policy_loss` metrics; step: optimizer steps applied so far; grads: the
    accumulated LoRA gradients the step used (before clipping)."""

    loss: jax.Array
    grad_norm: jax.Array
    logprobs: jax.Array
    metrics: dict[str, jax.Array]
    step: int
    grads: nnx.State | None = None


DEFAULT_LOSS = LossSettings()  # frozen: safe to share as a default
# One program for the whole gradient tree (eagerly, optax's norm runs and compiles a few small ops per leaf
# and per sharding: ~200 compiles per step on a mesh of several processes).
_global_norm = jax.jit(optax.tree.norm)


def grpo_update(model: nnx.Module, optimizer: LoRAOptimizer, prompt, responses, response_mask, old_logprobs,
                advantages, *, mode: str = "shared_prefix", loss: LossSettings = DEFAULT_LOSS,
                prefix_cache: KVCache | None = None) -> UpdateResult:
    """G per-sample backwards in `mode`, accumulated, then exactly one AdamW step on the adapters.

    Shapes as `gradients.lora_gradients`: prompt [P], responses / mask / old log-probs [G,R],
    advantages [G]. Raises `NonFiniteGradientError` (nothing updated) on NaN/Inf.
    """
    result = lora_gradients(model, prompt, responses, response_mask, old_logprobs, advantages, mode=mode,
                            loss=loss, prefix_cache=prefix_cache)
    grad_norm = _global_norm(_pure(result.grads))
    optimizer.apply(model, result.grads, result.loss)
    return UpdateResult(loss=result.loss, grad_norm=grad_norm, logprobs=result.logprobs, metrics=result.metrics,
                        step=optimizer.step, grads=result.grads)
