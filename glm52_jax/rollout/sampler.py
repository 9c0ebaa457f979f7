"""Policy sampler: chunked prefill into the DSA cache, then jitted decode of G samples.

One request = one prompt shared by G samples. The prompt is prefilled once at batch 1, and one
`lax.scan` decodes `max_new_tokens` steps for all samples against that one prompt cache (read only,
never copied per sample) plus a per-sample suffix cache of the new tokens (`model/shared_cache.py`).

Prefill modes:
  chunked  (default) chunks at absolute multiples of `chunk_size`, each against the cache so far,
           so a prefix-cache hit recomputes exactly the chunks a cold run would and the results
           are bit-identical.
  whole    a cold prompt runs as one uncached forward (`GlmMoeDsa.prefill`): under a mesh that
           shards the sequence, the explicit context-parallel path (sharded queries, key side
           all-gathered once per layer) instead of a chunk loop whose every chunk re-reads the
           whole sharded cache. A prefix-cache hit still continues in chunks, so a warm run
           equals a cold one up to float rounding, not bit for bit.

Old log-probs (what GRPO's importance ratio divides by): for each generated token, the float32
log-probability of that token under the policy's full next-token distribution at the sampling
temperature, `log_softmax(logits / T)[token]`, *before* top-k / top-p truncation (as verl and
vLLM report them). Greedy decoding (T = 0) reports `log_softmax(logits)[token]`.

Axis letters: G samples, P prompt tokens, N new tokens, D model dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax import choices
from glm52_jax.model.kv_cache import KVCache, slot_capacity, slot_ways
from glm52_jax.model.shared_cache import SuffixCache
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel import watchdog
from glm52_jax.rollout.cache import PrefixCache, fit_capacity

log = logging.getLogger(__name__)

# The cache is read inside loops (the indexer's key loop) and then updated in place. XLA:CPU's default
# copy insertion copies every cache array read that way at the top level of a step (layer segments
# that are not scanned); region analysis proves the copies unnecessary (measured at 16K slots, tiny
# model, G=2: ~50 -> ~25 ms per decode step). A DebugOptions field, ignored by other backends.
CACHE_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}

PREFILL_MODES = choices.PREFILL_MODES
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
PAD_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature=0` is greedy; `top_k=0` and `top_p=1` disable truncation."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    num_samples: int = 1
    seed: int = 0

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {self.num_samples!r}")
        bad = [t for t in self.stop_token_ids if not (0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


@dataclasses.dataclass
class SampleResult:
    tokens: np.ndarray  # [G, N] int32, PAD_TOKEN after a sample finishes
    logprobs: np.ndarray  # [G, N] float32 old log-probs, 0 after a sample finishes
    lengths: np.ndarray  # [G] tokens generated, including the stop token
    finish_reasons: list[str]  # per sample: "stop" or "length"
    prompt_len: int
    prefix_hit_tokens: int  # prompt tokens taken from the prefix cache
    prefill_seconds: float
    decode_seconds: float

    def completion(self, i: int) -> list[int]:
        return [int(t) for t in self.tokens[i, : self.lengths[i]]]


def _truncate(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Masks logits outside the top-k and the top-p nucleus. `logits: [G,V]` (already / T)."""
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token when the mass strictly before it is < top_p (so the top token always stays).
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def prefill_chunk(model: GlmMoeDsa, ids: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One chunked-prefill call (`Sampler` jits it): `forward_cached` of ids [1,S] after the
    cache's `length` tokens. Returns (hidden states [1,S,D], the cache with the S slots written)."""
    return model.forward_cached(ids, cache)


def prefill_whole(model: GlmMoeDsa, ids: jax.Array, capacity: int) -> tuple[jax.Array, KVCache]:
    """The whole-prompt prefill (`prefill_mode="whole"`): `model.prefill` of ids [1,P], the uncached
    (context-parallel under a sequence-sharded mesh) forward that also emits the cache. Returns
    (hidden state of the last prompt token [1,D], the batch-1 cache of `capacity` slots holding P)."""
    h, cache = model.prefill(ids, capacity)
    return h[:, -1], cache


def decode_steps(model: GlmMoeDsa, prompt: KVCache, suffix: SuffixCache, h_last: jax.Array, keys: jax.Array,
                 forced: jax.Array | None, *, steps: int, temperature: float, top_k: int, top_p: float,
                 stop_ids: tuple[int, ...], on_step: Callable[[int, int], None] | None = None
                 ) -> tuple[jax.Array, jax.Array, SuffixCache]:
    """`steps` (= N) decode steps for G rows in one `lax.scan` (`Sampler` jits it).

    Each step: logits of the current hidden state, a token (sampled at `temperature` after top-k /
    top-p truncation, greedy at 0, or `forced`), its old log-prob, then one `forward_shared` token.
    prompt: the batch-1 cache holding the prompt (only read); suffix: the G rows' empty suffix cache of
    >= N slots (the loop carry); h_last: [G,D] hidden state of the last prompt token; keys: [G] PRNG keys
    (step t folds in t); forced: [G,N] int32 ids to feed instead of sampling, or None.
    on_step: None, or `fn(done, steps)` called on the host after each step (progress of the one compiled
      loop: a `jax.debug.callback` of the step counter, unordered, so the device does not wait for the host;
      the callback sees the steps in order of completion, and on one process, the one holding device 0).
    Returns (tokens [G,N] int32, PAD_TOKEN after a row's stop token; log-probs [G,N] float32, 0 there;
    the suffix after the N tokens). Returning the suffix lets a caller that donates it have XLA run the
    loop on the donated buffers (aliased to this output).
    """
    stop = jnp.asarray(stop_ids if stop_ids else (-2,), jnp.int32)

    def step(carry, t):
        suffix, h_last, done = carry
        logits = model.logits(h_last)  # [G,V] f32
        scaled = logits / temperature if temperature > 0 else logits
        logp_all = jax.nn.log_softmax(scaled, axis=-1)
        if forced is not None:
            token = forced[:, t]
        elif temperature > 0:
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(keys)
            token = jax.vmap(jax.random.categorical)(step_keys, _truncate(scaled, top_k, top_p))
        else:
            token = jnp.argmax(logits, axis=-1)
        token = token.astype(jnp.int32)
        logp = jnp.take_along_axis(logp_all, token[:, None], axis=-1)[:, 0]
        out_token = jnp.where(done, PAD_TOKEN, token)
        out_logp = jnp.where(done, 0.0, logp)
        done = done | jnp.isin(token, stop)
        h, suffix = model.forward_shared(jnp.where(out_token < 0, 0, out_token)[:, None], prompt, suffix)
        if on_step is not None:
            jax.debug.callback(lambda i: on_step(int(i) + 1, steps), t)
        return (suffix, h[:, 0], done), (out_token, out_logp)

    done0 = jnp.zeros(h_last.shape[:1], bool)
    (suffix, _, _), (tokens, logps) = jax.lax.scan(step, (suffix, h_last, done0), jnp.arange(steps))
    return tokens.T, logps.T, suffix


class Sampler:
    """Samples from a model with a bounded prefix cache shared across requests."""

    def __init__(self, model: GlmMoeDsa, *, chunk_size: int = 2048, prefix_cache_bytes: int = 1 << 30,
                 capacity_multiple: int = 256, progress: Callable[[int, int, float, float], None] | None = None,
                 prefill_mode: str = "chunked", decode_progress: Callable[[int, int], None] | None = None):
        if chunk_size <= 0 or capacity_multiple <= 0:
            raise ValueError("chunk_size and capacity_multiple must be positive")
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode: expected one of {PREFILL_MODES}, got {prefill_mode!r}")
        self.model = model
        self.cfg = model.cfg
        self.chunk_size = chunk_size
        self.prefill_mode = prefill_mode
        self.capacity_multiple = capacity_multiple
        self.prefix_cache = PrefixCache(max_bytes=prefix_cache_bytes)
        self.progress = progress or _log_progress
        self.graphdef, self.state = nnx.split(model)
        self.prefill_calls = 0  # chunks computed (not reused); lets tests and benchmarks see cache hits

        def chunk(state, ids, cache):
            return prefill_chunk(nnx.merge(self.graphdef, state), ids, cache)

        def whole(state, ids, capacity):
            return prefill_whole(nnx.merge(self.graphdef, state), ids, capacity)

        def decode(state, prompt, suffix, h_last, keys, forced, **kw):
            return decode_steps(nnx.merge(self.graphdef, state), prompt, suffix, h_last, keys, forced,
                                on_step=decode_progress, **kw)

        self._prefill_chunk = jax.jit(chunk, compiler_options=CACHE_COMPILER_OPTIONS)
        self._prefill_whole = jax.jit(whole, static_argnames=("capacity",))
        # Built inside jit so that, under a mesh, each device allocates only its share of the slots.
        self._empty_cache = jax.jit(lambda capacity: model.init_cache(1, capacity), static_argnums=0)
        self._empty_suffix = jax.jit(lambda rows, capacity: model.init_suffix(rows, capacity), static_argnums=(0, 1))
        # The suffix is donated (made afresh per request) and the decode loop updates it in place; the
        # batch-1 prompt cache is only read, and not donated: the prefix cache keeps it.
        self._decode = jax.jit(decode, static_argnames=("steps", "temperature", "top_k", "top_p", "stop_ids"),
                               donate_argnums=(2,), compiler_options=CACHE_COMPILER_OPTIONS)

    # -- public ----------------------------------------------------------------------------------
    def policy_updated(self) -> None:
        """Call after the model's weights changed (an optimizer step): takes the new weights and
        drops the prefix cache, whose KV was computed with the old ones."""
        self.graphdef, self.state = nnx.split(self.model)
        self.prefix_cache.clear()

    def capacity_for(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots for a request: prompt + new tokens rounded up so that `capacity_multiple` and the
        devices sharding the slots under the current mesh divide it (may pass the position limit: padding)."""
        return slot_capacity(prompt_len + max_new_tokens, self.capacity_multiple, slot_ways())

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams, *,
               forced_tokens: np.ndarray | None = None) -> SampleResult:
        """Samples `params.num_samples` continuations of one prompt.

        forced_tokens: optional [G, N] ids to feed instead of sampling (teacher forcing); the
        result then holds their log-probs under the policy.
        """
        prompt = self._check_prompt(prompt_ids, params)
        g, n = params.num_samples, params.max_new_tokens
        if forced_tokens is not None:
            forced_tokens = np.asarray(forced_tokens)
            if forced_tokens.shape != (g, n):
                raise ValueError(f"forced_tokens must have shape (num_samples, max_new_tokens) = {(g, n)}, "
                                 f"got {forced_tokens.shape}")
            if forced_tokens.min() < 0 or forced_tokens.max() >= self.cfg.vocab_size:
                raise ValueError("forced_tokens has ids outside the vocabulary")
        capacity = self.capacity_for(len(prompt), n)
        t0 = time.perf_counter()
        cache, h_last, hit = self.prefill(prompt, capacity)
        t1 = time.perf_counter()
        with watchdog.phase("decode", program="decode"):
            tokens, logps, _ = self.decode(cache, h_last, params, forced_tokens)
            tokens, logps = np.asarray(tokens), np.asarray(logps)
        t2 = time.perf_counter()
        lengths = (tokens != PAD_TOKEN).sum(-1)
        reasons = [FINISH_STOP if lengths[i] > 0 and tokens[i, lengths[i] - 1] in params.stop_token_ids
                   else FINISH_LENGTH for i in range(g)]
        return SampleResult(tokens, logps, lengths, reasons, len(prompt), hit, t1 - t0, t2 - t1)

    def decode(self, cache: KVCache, h_last: jax.Array, params: SamplingParams,
               forced_tokens: np.ndarray | None = None) -> tuple[jax.Array, jax.Array, SuffixCache]:
        """`params.num_samples` continuations of a prefilled prompt (batch-1 `cache`, `h_last: [1,D]`; both
        kept): (tokens [G,N], log-probs [G,N], the G rows' suffix cache of the N tokens). `sample` checks
        the inputs."""
        g = params.num_samples
        keys = jax.random.split(jax.random.key(params.seed), g)
        return self._decode(
            self.state, cache, self._empty_suffix(g, params.max_new_tokens), jnp.repeat(h_last, g, axis=0), keys,
            None if forced_tokens is None else jnp.asarray(forced_tokens, jnp.int32),
            steps=params.max_new_tokens, temperature=float(params.temperature), top_k=params.top_k,
            top_p=float(params.top_p), stop_ids=tuple(params.stop_token_ids))

    def prefill(self, prompt: Sequence[int], capacity: int) -> tuple[KVCache, jax.Array, int]:
        """Batch-1 cache of `prompt` plus the last token's hidden state [1,D]; reuses cached prefixes.

        Returns (cache, h_last, prompt tokens reused from the prefix cache). Runs as the watchdog's phase
        "prefill" and waits for the last chunk, so that a prefill that hangs is named as one (not the decode
        that would otherwise wait for it).
        """
        with watchdog.phase("prefill", program=f"prefill_{self.prefill_mode}"):
            cache, h_last, hit_len = self._prefill(prompt, capacity)
            jax.block_until_ready(h_last)
        return cache, h_last, hit_len

    def _prefill(self, prompt: Sequence[int], capacity: int) -> tuple[KVCache, jax.Array, int]:
        prompt = list(prompt)
        stored = self.prefix_cache.whole(prompt)
        if stored is not None:  # this very prompt was prefilled: no compute
            return fit_capacity(stored[0], capacity), stored[1], len(prompt)
        # Reuse at most len-1 tokens (the last one must run to give h_last), and only whole chunks,
        # so the recomputed chunks are exactly those of a cold run.
        hit_len, cache = self.prefix_cache.lookup(prompt, limit=len(prompt) - 1, multiple=self.chunk_size)
        total = len(prompt)
        start = time.perf_counter()
        if self.prefill_mode == "whole" and cache is None:  # emits its own cache: no empty one to build
            h_last, cache = self._prefill_whole(self.state, jnp.asarray(prompt, jnp.int32)[None], capacity)
            self.prefill_calls += 1
            rate = total / max(time.perf_counter() - start, 1e-9)
            self.progress(total, total, rate, 0.0)
            self.prefix_cache.insert(prompt, cache, h_last)
            return cache, h_last, 0
        if cache is None:
            cache, hit_len = self._empty_cache(capacity), 0
        else:
            cache = fit_capacity(cache, capacity)
        done = hit_len
        h_last = None
        while done < total:
            end = min(total, (done // self.chunk_size + 1) * self.chunk_size)
            ids = jnp.asarray(prompt[done:end], jnp.int32)[None]
            h, cache = self._prefill_chunk(self.state, ids, cache)
            self.prefill_calls += 1
            h_last = h[:, -1]
            done = end
            elapsed = time.perf_counter() - start
            rate = (done - hit_len) / max(elapsed, 1e-9)
            self.progress(done, total, rate, (total - done) / max(rate, 1e-9))
            if done % self.chunk_size == 0 or done == total:
                self.prefix_cache.insert(prompt[:done], cache, h_last if done == total else None)
        return cache, h_last, hit_len

    def _check_prompt(self, prompt_ids, params: SamplingParams) -> list[int]:
        params.validate(self.cfg.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}")
        limit = self.cfg.max_position_embeddings
        if len(prompt) + params.max_new_tokens > limit:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"position capacity max_position_embeddings={limit}")
        return prompt


def _log_progress(done: int, total: int, tokens_per_s: float, eta_s: float) -> None:
    log.info("prefill %d/%d tokens, %.0f tok/s, ETA %.1f s", done, total, tokens_per_s, eta_s)
