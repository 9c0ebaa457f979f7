"""GRPO gradients of the LoRA adapters for one prompt and its G responses (DESIGN §5).

Three modes, all with one backward per sample (a `lax.scan` over the G responses that accumulates
gradients), differentiating the LoRA variables only (the base is frozen):

  conventional   every sample runs forward + backward over its whole prompt + response.
  response_only  the prompt prefix (its KV cache) is a constant: one no-grad prefill of
                 prompt[:-1] (or the sampler's cache, passed as `prefix_cache`), then each sample
                 runs [prompt[-1]] + response[:-1] against it. Drops the gradient that flows
                 through the prefix (the seed measured ~1.2% relative L2 on its run).
  shared_prefix  exact: the prefix runs once under `jax.vjp`; each sample returns gradients for
                 the LoRA params and for the prefix cache; the cache cotangents are summed and
                 pulled back through the prefix once. Equals `conventional` up to float
                 reassociation at about one prefix forward + backward instead of G.

Position p of every mode predicts token p+1: the R log-probs of a response come from the
hidden states at positions P-1 .. P+R-2 (inputs prompt[-1], response[:-1]).

The per-sample losses are `grpo.policy_loss` with the batch-level normaliser (the global valid
token count for token-mean, the valid sequence count for the seq-mean modes), so they sum to the
batch loss and the accumulated per-sample gradients are the batch gradient.

Axis letters: P prompt tokens, G responses, R response tokens, D model, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax.choices import GRADIENT_MODES
from glm52_jax.model.context_parallel import MAX_CACHED_QUERIES
from glm52_jax.model.kv_cache import KVCache, slot_capacity, slot_stride, slot_ways
from glm52_jax.model.lora import LoRA
from glm52_jax.model.transformer import target_logprobs
from glm52_jax.rl import grpo

MODES = GRADIENT_MODES


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Static GRPO policy-loss settings (see `grpo.policy_loss`)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    norm_constant: float | None = None

    def __post_init__(self):
        if self.loss_agg_mode not in grpo.LOSS_AGG_MODES:
            raise ValueError(f"LossSettings.loss_agg_mode must be one of {grpo.LOSS_AGG_MODES}, "
                             f"got {self.loss_agg_mode!r}")


@dataclasses.dataclass(frozen=True)
class GradientResult:
    """What one gradient computation returns.

    grads: LoRA-shaped `nnx.State` (same tree as `nnx.state(model, LoRA)`), d(loss)/d(adapters).
    loss: [] the batch loss (sum of `sample_losses`).
    sample_losses: [G] per-sample shares of the batch loss.
    logprobs: [G,R] the new (trainer) log-probs of the response tokens.
    metrics: batch `grpo.policy_loss` metrics (pg_loss, clipfrac, clipfrac_lower, approx_kl).
    """

    grads: nnx.State
    loss: jax.Array
    sample_losses: jax.Array
    logprobs: jax.Array
    metrics: dict[str, jax.Array]


def split_lora(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, LoRA state, everything else); raises if the model has no adapters."""
    graphdef, lora, frozen = nnx.split(model, LoRA, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("the model has no LoRA adapters: build it with ModelOptions(lora=LoRAConfig(...)) "
                         "or add them with glm52_jax.model.lora.attach_lora")
    return graphdef, lora, frozen


# ------------------------------------------------------------------------------------------------
# Pieces shared by the modes (all traced; `model` is merged from graphdef + states).


# Log-prob of response targets from hidden states: the same chunked head as `token_logprobs`.
response_logprobs = target_logprobs


def prefill(model, prompt: jax.Array, capacity: int, cache_dtype: str | None = None) -> KVCache:
    """Batch-1 cache holding `prompt[:-1]` (the prefix every response attends to); `prompt: [P]`; stored as
    `cache_dtype` (default the model's `opts.cache_dtype`).

    The whole-prompt forward (`model.prefill`: the uncached path, context-parallel under a sequence-sharded
    mesh), not one cached chunk of P-1 queries: a cached chunk that long is scored against the whole cache
    and, under shared_prefix's VJP, keeps what that costs (measured at 32K on 32 H20: train temporaries
    20.4 TB per device through the cached chunk)."""
    _, cache = model.prefill(prompt[None, :-1], capacity, cache_dtype)
    return cache


def full_sequence_logprobs(model, prompt: jax.Array, response: jax.Array, chunk: int) -> jax.Array:
    """Conventional: one uncached forward over prompt + response[:-1]; `[P], [R] -> [R]`."""
    ids = jnp.concatenate([prompt, response[:-1]])[None]
    h = model.hidden_states(ids)[:, prompt.shape[0] - 1:]
    return response_logprobs(model, h, response[None], chunk)[0]


def cached_logprobs(model, cache: KVCache, last_prompt_token: jax.Array, responses: jax.Array,
                    chunk: int) -> jax.Array:
    """[prompt[-1]] + response[:-1] of each of `responses: [G,R]` run after the batch-1 prefix cache, which
    the G rows share (`model.forward_shared` with an empty suffix, stored like the cache: the cache is never
    copied per row) -> [G,R]."""
    rows = responses.shape[0]
    ids = jnp.concatenate([jnp.broadcast_to(last_prompt_token, (rows, 1)), responses[:, :-1]], axis=1)
    h, _ = model.forward_shared(ids, cache, model.init_suffix(rows, 0, cache_dtype=cache.cache_dtype))
    return response_logprobs(model, h, responses, chunk)


def _normalisers(mask: jax.Array, settings: LossSettings) -> dict[str, jax.Array]:
    """Batch-level denominators that make per-sample losses sum to the batch loss."""
    valid = (mask != 0).astype(jnp.float32)
    if settings.loss_agg_mode == "token-mean":
        return {"num_tokens": jnp.maximum(valid.sum(), 1.0)}
    if settings.loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return {"num_seqs": jnp.maximum((valid.sum(-1) > 0).sum().astype(jnp.float32), 1.0)}
    return {}


def sample_loss(logp: jax.Array, old: jax.Array, adv: jax.Array, mask: jax.Array, settings: LossSettings,
                norm: dict[str, jax.Array]) -> jax.Array:
    """One sample's share of the batch loss: `[R], [R], [], [R] -> []`."""
    loss, _ = grpo.policy_loss(logp[None], old[None], adv[None], mask[None], clip_ratio_low=settings.clip_ratio_low,
                               clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c,
                               loss_agg_mode=settings.loss_agg_mode, norm_constant=settings.norm_constant, **norm)
    return loss


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


# ------------------------------------------------------------------------------------------------
# The three modes: each returns (LoRA grads, sample losses [G], log-probs [G,R]).


def _per_sample(params, batch, settings, norm, logprobs):
    """One backward per sample, accumulated over a scan of the G samples.

    `params`: the differentiated pytree; `logprobs(params, response [R]) -> [R]`.
    Returns (summed gradients shaped like params, sample losses [G], log-probs [G,R]).
    """
    def body(acc, xs):
        response, mask, old, adv = xs

        def loss_fn(params):
            logp = logprobs(params, response)
            return sample_loss(logp, old, adv, mask, settings, norm), logp

        (loss, logp), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return _add(acc, g), (loss, logp)

    grads, (losses, logps) = jax.lax.scan(body, _zeros(params), batch)
    return grads, losses, logps


def _conventional(graphdef, lora, frozen, prompt, batch, settings, norm, chunk, prefix=None):
    def logprobs(lora, response):
        return full_sequence_logprobs(nnx.merge(graphdef, lora, frozen), prompt, response, chunk)

    return _per_sample(lora, batch, settings, norm, logprobs)


def _response_only(graphdef, lora, frozen, prompt, batch, settings, norm, chunk, prefix):
    if prefix is None:  # one program with its own prefill (`lora_gradients` prefills separately)
        prefix = prefill_split(graphdef, lora, frozen, prompt,
                               capacity=prefix_capacity(prompt.shape[0], batch[0].shape[1]))
    cache = jax.lax.stop_gradient(prefix)  # a constant: no gradient through the prefix

    def logprobs(lora, response):
        return cached_logprobs(nnx.merge(graphdef, lora, frozen), cache, prompt[-1], response[None], chunk)[0]

    return _per_sample(lora, batch, settings, norm, logprobs)


def _shared_prefix(graphdef, lora, frozen, prompt, batch, settings, norm, chunk, prefix=None):
    capacity = prefix_capacity(prompt.shape[0], batch[0].shape[1])
    length = jnp.asarray(prompt.shape[0] - 1, jnp.int32)

    def prefix_arrays(lora):
        # Differentiated: kept in the parameter dtype whatever `cache_dtype` says (e4m3 rounding has no gradient).
        cache = prefill(nnx.merge(graphdef, lora, frozen), prompt, capacity, cache_dtype="auto")
        return cache.c_kv, cache.k_rope, cache.index_k

    # The prefix runs once; its VJP (residuals: per-layer scan inputs under remat) is kept.
    arrays, prefix_vjp = jax.vjp(prefix_arrays, lora)

    def logprobs(params, response):
        lora, arrays = params
        # `prefill` lays its cache out as `slot_stride` says for this capacity under the current mesh.
        cache = KVCache(*arrays, length, stride=slot_stride(capacity))
        return cached_logprobs(nnx.merge(graphdef, lora, frozen), cache, prompt[-1],
                               response[None], chunk)[0]

    # Per sample: gradients for the LoRA params and for the prefix cache, both summed over samples.
    (grads, cache_cotangent), losses, logps = _per_sample((lora, arrays), batch, settings, norm, logprobs)
    (prefix_grads,) = prefix_vjp(cache_cotangent)  # the one prefix backward
    return _add(grads, prefix_grads), losses, logps


_MODE_FNS = {"conventional": _conventional, "response_only": _response_only, "shared_prefix": _shared_prefix}


def compute_gradients(graphdef: nnx.GraphDef, lora: nnx.State, frozen: nnx.State, prompt: jax.Array,
                      responses: jax.Array, mask: jax.Array, old: jax.Array, adv: jax.Array, prefix: KVCache | None,
                      *, mode: str, settings: LossSettings, chunk: int):
    """The traced core of `lora_gradients` (what it jits; plan mode compiles it), on the split model.

    graphdef, lora, frozen: `split_lora(model)`. prompt: [P] int32; responses: [G,R] int32;
    mask: [G,R] response mask; old: [G,R] float32 old log-probs; adv: [G] float32 advantages;
    prefix: response_only: the batch-1 cache holding prompt[:-1] (None: prefilled inside), else None.
    mode: one of `MODES`; settings, chunk: static (loss settings, positions per logits chunk).
    Returns (LoRA grads shaped like `lora`, sample losses [G], new log-probs [G,R], batch metrics).
    """
    norm = _normalisers(mask, settings)
    grads, losses, logps = _MODE_FNS[mode](graphdef, lora, frozen, prompt, (responses, mask, old, adv), settings,
                                           norm, chunk, prefix)
    _, metrics = grpo.policy_loss(logps, old, adv, mask, clip_ratio_low=settings.clip_ratio_low,
                                  clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c,
                                  loss_agg_mode=settings.loss_agg_mode, norm_constant=settings.norm_constant,
                                  **norm)
    return grads, losses, logps, metrics


compute_gradients_jit = jax.jit(compute_gradients, static_argnames=("graphdef", "mode", "settings", "chunk"))


CAPACITY_MULTIPLE = 256


def prefix_capacity(prompt_len: int, response_len: int) -> int:
    """Cache slots for the prefix plus one response (P-1+R), rounded up like the sampler's cache (a
    multiple of 256 and of the devices sharding the slots under the current mesh); padding slots are
    never visible to a query."""
    return slot_capacity(prompt_len - 1 + response_len, CAPACITY_MULTIPLE, slot_ways())


def prefill_split(graphdef: nnx.GraphDef, lora: nnx.State, frozen: nnx.State, prompt: jax.Array, *,
                  capacity: int) -> KVCache:
    """`prefill` of the model given split as `split_lora` returns it: prompt [P] -> the batch-1 cache
    of `capacity` slots holding prompt[:-1] (response_only's prefix)."""
    return prefill(nnx.merge(graphdef, lora, frozen), prompt, capacity)


# A separate program, so response_only compiles the same gradient program with or without a
# caller-supplied prefix cache.
prefill_split_jit = jax.jit(prefill_split, static_argnames=("graphdef", "capacity"))


def cached_response_logprobs(graphdef: nnx.GraphDef, state: nnx.State, prefix: KVCache, prompt: jax.Array,
                             responses: jax.Array, *, chunk: int = 1024) -> jax.Array:
    """Log-probs of `responses: [G,R]` after a batch-1 cache of `prompt[:-1]`: -> [G,R] float32.

    response_only's forward without a gradient: one pass over the G x R response tokens, all rows against
    the one prompt cache `prefix` (e.g. the sampler's; its keys scored once for all rows), never a
    whole-sequence forward. The rows go in groups of at most `MAX_CACHED_QUERIES` tokens (a divisor of G),
    the most a chunk may hold and still score the prompt where its slots live under context parallelism.
    """
    model = nnx.merge(graphdef, state)
    rows, length = responses.shape
    group = max([d for d in range(1, rows + 1) if rows % d == 0 and d * length <= MAX_CACHED_QUERIES] or [1])
    groups = responses.reshape(rows // group, group, length)
    out = jax.lax.map(lambda part: cached_logprobs(model, prefix, prompt[-1], part, chunk), groups)
    return out.reshape(rows, length)


cached_response_logprobs_jit = jax.jit(cached_response_logprobs, static_argnames=("graphdef", "chunk"))


# ------------------------------------------------------------------------------------------------
# Public entry point.


def check_inputs(prompt, responses, mask, old, adv, *, mask_name: str = "response_mask") -> None:
    """Shapes of one gradient batch (numpy or jax): prompt [P] (P >= 2), responses / mask / old [G,R], adv [G];
    a ValueError names the argument (`mask_name`: what the caller calls the mask)."""
    if prompt.ndim != 1 or prompt.shape[0] < 2:
        raise ValueError(f"prompt must be [P] token ids with P >= 2, got shape {prompt.shape}")
    if responses.ndim != 2 or responses.shape[1] < 1:
        raise ValueError(f"responses must be [G,R] token ids with R >= 1, got shape {responses.shape}")
    for name, a in ((mask_name, mask), ("old_logprobs", old)):
        if a.shape != responses.shape:
            raise ValueError(f"{name} has shape {a.shape}, expected {responses.shape}")
    if adv.shape != responses.shape[:1]:
        raise ValueError(f"advantages has shape {adv.shape}, expected {responses.shape[:1]}")


def prefix_for_response(prefix_cache: KVCache, prompt_len: int, response_len: int) -> KVCache:
    """The sampler's batch-1 cache, cut back to the P-1 prefix tokens (later slots get rewritten)."""
    need = prompt_len - 1 + response_len
    if prefix_cache.batch != 1:
        raise ValueError(f"prefix_cache must hold one sequence (batch 1), got batch {prefix_cache.batch}")
    if int(prefix_cache.length) < prompt_len - 1:
        raise ValueError(f"prefix_cache holds {int(prefix_cache.length)} tokens, fewer than the "
                         f"{prompt_len - 1} prompt-prefix tokens")
    if prefix_cache.capacity < need:
        raise ValueError(f"prefix_cache capacity {prefix_cache.capacity} < {need} (prompt - 1 + response tokens)")
    return dataclasses.replace(prefix_cache, length=jnp.asarray(prompt_len - 1, jnp.int32))


def gradient_inputs(model: nnx.Module, prompt, responses, response_mask, old_logprobs, advantages, *, mode: str,
                    prefix_cache: KVCache | None = None, jit: bool = True) -> tuple:
    """`(graphdef, lora, frozen, (prompt, responses, mask, old, adv, prefix))`: the split model and the checked
    device batch `compute_gradients` takes (arguments as `lora_gradients`). response_only without a
    `prefix_cache` prefills the prompt here, as a program of its own (`prefill_split_jit`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    prompt, responses = jnp.asarray(prompt, jnp.int32), jnp.asarray(responses, jnp.int32)
    mask = jnp.asarray(response_mask)
    old, adv = jnp.asarray(old_logprobs, jnp.float32), jnp.asarray(advantages, jnp.float32)
    check_inputs(prompt, responses, mask, old, adv)
    if prefix_cache is not None:
        if mode != "response_only":
            raise ValueError(f"prefix_cache is only used by response_only; {mode} differentiates through "
                             "the prefix and must run it itself")
        prefix_cache = prefix_for_response(prefix_cache, prompt.shape[0], responses.shape[1])
    graphdef, lora, frozen = split_lora(model)
    if mode == "response_only" and prefix_cache is None:
        capacity = prefix_capacity(prompt.shape[0], responses.shape[1])
        prefix_cache = (prefill_split_jit if jit else prefill_split)(graphdef, lora, frozen, prompt, capacity=capacity)
    return graphdef, lora, frozen, (prompt, responses, mask, old, adv, prefix_cache)


def lora_gradients(model: nnx.Module, prompt, responses, response_mask, old_logprobs, advantages, *,
                   mode: str, loss: LossSettings = LossSettings(), prefix_cache: KVCache | None = None,
                   logprob_chunk: int = 1024, jit: bool = True) -> GradientResult:
    """GRPO loss, its LoRA gradient and the new log-probs for one prompt and G responses.

    Args:
      model: a `GlmMoeDsa` with LoRA adapters (only they are differentiated).
      prompt: [P] int token ids (P >= 2).
      responses: [G,R] int token ids (padding after the stop token is masked out).
      response_mask: [G,R] 1 for response tokens that count, 0 for padding.
      old_logprobs: [G,R] sampler (behaviour) log-probs.
      advantages: [G] per-sample advantages (e.g. `grpo.group_advantages`).
      mode: one of `MODES`.
      loss: static policy-loss settings.
      prefix_cache: response_only only: a batch-1 cache whose first P-1 slots hold the prompt
        (e.g. the sampler's after prefilling it; its length may exceed P-1, slots from P-1 on
        are rewritten) with capacity >= P-1+R; skips the no-grad prefill.
      logprob_chunk: positions per logits chunk.
      jit: compile the whole computation (False runs it op by op, e.g. to count calls).
    """
    graphdef, lora, frozen, batch = gradient_inputs(model, prompt, responses, response_mask, old_logprobs,
                                                    advantages, mode=mode, prefix_cache=prefix_cache, jit=jit)
    fn = compute_gradients_jit if jit else compute_gradients
    grads, losses, logps, metrics = fn(graphdef, lora, frozen, *batch, mode=mode, settings=loss, chunk=logprob_chunk)
    return GradientResult(grads=grads, loss=jnp.sum(losses), sample_losses=losses, logprobs=logps, metrics=metrics)
