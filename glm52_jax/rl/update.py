"""One GRPO update: G per-sample backwards (a gradient mode), accumulation, one AdamW step on LoRA.

The whole update is one compiled program, `grpo_step` (plan mode's "train" program compiles the same function,
so the plan measures what runs): gradients, their global norm, per-adapter finiteness flags, and the clipped
AdamW step. The host reads the flags afterwards and only then commits the new adapters and moments.

Only the `LoRA` variables are trained; the base (`nnx.Param`) is never touched. A non-finite loss or
gradient aborts the step before anything changes: `NonFiniteGradientError` names the first
offending adapter, and params and optimizer state stay byte-identical (the program's outputs are dropped).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glm52_jax.model.kv_cache import KVCache
from glm52_jax.model.lora import LoRA
from glm52_jax.rl import gradients
from glm52_jax.rl.gradients import LossSettings


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


def _flags(grads, loss):
    return jax.tree.map(lambda g: jnp.all(jnp.isfinite(g)), grads), jnp.isfinite(loss)


_finite_flags = jax.jit(_flags)


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
    _raise_unless_finite(*_finite_flags(grads, loss))


def _raise_unless_finite(flags, loss_ok) -> None:
    flags, loss_ok = jax.device_get((flags, loss_ok))
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


class StepOutputs(NamedTuple):
    """What `grpo_step` returns: params / opt_state: the adapters and AdamW state after the step (to commit
    only when finite); loss []; grad_norm []: global L2 before clipping; logprobs [G,R]; metrics; grads: the
    accumulated LoRA gradients; flags: per-leaf finiteness of `grads`; loss_ok []: the loss's."""

    params: Any
    opt_state: Any
    loss: jax.Array
    grad_norm: jax.Array
    logprobs: jax.Array
    metrics: dict
    grads: Any
    flags: Any
    loss_ok: jax.Array


def grpo_step(adamw: AdamWConfig, graphdef: nnx.GraphDef, lora: nnx.State, frozen: nnx.State,
              opt_state, prompt, responses, mask, old, adv, prefix: KVCache | None, *, mode: str,
              settings: LossSettings, chunk: int) -> StepOutputs:
    """One GRPO update as one traced function (`grpo_update` jits it; plan mode's train program compiles it):
    `gradients.compute_gradients` in `mode`, the global gradient norm, finiteness flags, then `adamw`'s (clip +
    AdamW) and `apply_updates` on the pure LoRA params. Shapes as `compute_gradients`; `opt_state` is
    `adamw.transform()`'s. `adamw` (a frozen dataclass) is the static key: equal settings share one compile."""
    grads, losses, logps, metrics = gradients.compute_gradients(
        graphdef, lora, frozen, prompt, responses, mask, old, adv, prefix, mode=mode, settings=settings, chunk=chunk)
    pure, params, loss = _pure(grads), _pure(lora), losses.sum()
    flags, loss_ok = _flags(pure, loss)
    updates, new_opt = adamw.transform().update(pure, opt_state, params)
    return StepOutputs(optax.apply_updates(params, updates), new_opt, loss, optax.tree.norm(pure), logps, metrics,
                       grads, flags, loss_ok)


grpo_step_jit = jax.jit(grpo_step, static_argnames=("adamw", "graphdef", "mode", "settings", "chunk"))


def grpo_update(model: nnx.Module, optimizer: LoRAOptimizer, prompt, responses, response_mask, old_logprobs,
                advantages, *, mode: str = "shared_prefix", loss: LossSettings = DEFAULT_LOSS,
                prefix_cache: KVCache | None = None, logprob_chunk: int = 1024) -> UpdateResult:
    """G per-sample backwards in `mode`, accumulated, then exactly one AdamW step on the adapters: one program
    (`grpo_step`), then a host check of its finiteness flags before the model and optimizer take its outputs.

    Shapes as `gradients.lora_gradients`: prompt [P], responses / mask / old log-probs [G,R],
    advantages [G]. Raises `NonFiniteGradientError` (nothing updated) on NaN/Inf.
    """
    graphdef, lora, frozen, batch = gradients.gradient_inputs(
        model, prompt, responses, response_mask, old_logprobs, advantages, mode=mode, prefix_cache=prefix_cache)
    out = grpo_step_jit(optimizer.config, graphdef, lora, frozen, optimizer.opt_state, *batch, mode=mode, settings=loss,
                        chunk=logprob_chunk)
    _raise_unless_finite(out.flags, out.loss_ok)
    nnx.update(model, out.params)
    optimizer.opt_state = out.opt_state
    optimizer.step += 1
    return UpdateResult(loss=out.loss, grad_norm=out.grad_norm, logprobs=out.logprobs, metrics=out.metrics,
                        step=optimizer.step, grads=out.grads)
