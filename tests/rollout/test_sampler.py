"""Sampler: teacher-forced consistency, greedy parity with HF generate, prefix reuse, seeds, errors.

One model (a random HF model loaded into ours) and one sampler serve every test; prompt lengths
are 29 or 45 (so every prefill compiles only the 16-token chunk and the 13-token tail) and the
sampling settings repeat, so the whole file compiles a handful of decode programs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_reference import random_hf_model, save_hf

import glm52_jax
from glm52_jax import config
from glm52_jax.checkpoint.inventory import param_inventory
from glm52_jax.rollout.cache import PrefixCache
from glm52_jax.rollout.sampler import FINISH_LENGTH, FINISH_STOP, PAD_TOKEN, Sampler, SamplingParams

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8)
CFG = config.tiny()  # index_topk 32, IndexShare layers
SHORT, LONG = 29, 45  # prompt lengths below and above index_topk; both end in a 13-token chunk
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=5, num_samples=4, seed=1)
FORCED = SamplingParams(max_new_tokens=7, num_samples=2, temperature=1.0)  # with forced_tokens


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model(CFG, seed=4)


@pytest.fixture(scope="module")
def model(hf_model, tmp_path_factory):
    """Ours, loaded from the HF model's checkpoint (the same weights HF generates with)."""
    return glm52_jax.load_pretrained(save_hf(hf_model, tmp_path_factory.mktemp("hf")), dtype=jnp.float32,
                                     options=OPTS)


@pytest.fixture(scope="module")
def shared_sampler(model):
    return Sampler(model, chunk_size=16, capacity_multiple=64)


@pytest.fixture(scope="module")
def logprobs_fn(model):
    """Jitted `token_logprobs` (one compile per shape instead of an op-by-op forward)."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda st, ids: glm52_jax.token_logprobs(nnx.merge(graphdef, st), ids))
    return lambda ids: np.asarray(run(state, ids))


@pytest.fixture
def sampler(shared_sampler):
    """One sampler (so jitted functions compile once), with an empty prefix cache per test."""
    shared_sampler.prefix_cache = PrefixCache(max_bytes=1 << 30)
    shared_sampler.prefill_calls = 0
    return shared_sampler


def _prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab_size, n)]


def _forced(seed, params=FORCED):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (params.num_samples, params.max_new_tokens))


def _last_hidden(sampler, prompt):
    """h of the prompt's last token, [1,D], through the sampler's own (already compiled) prefill."""
    return sampler.prefill(prompt, 64)[1]


@pytest.mark.parametrize("prompt_len", [SHORT, LONG])
def test_teacher_forced_logprobs_match_token_logprobs(sampler, logprobs_fn, prompt_len):
    prompt = _prompt(prompt_len)
    forced = _forced(1)
    res = sampler.sample(prompt, FORCED, forced_tokens=forced)
    ids = jnp.asarray(np.concatenate([np.tile(prompt, (2, 1)), forced], 1), jnp.int32)
    ref = logprobs_fn(ids)[:, prompt_len - 1:]
    np.testing.assert_array_equal(res.tokens, forced)
    np.testing.assert_allclose(res.logprobs, ref, atol=1e-5, rtol=0)


def test_temperature_scales_old_logprobs(model, sampler):
    prompt = _prompt(SHORT)
    forced = _forced(2)
    base = sampler.sample(prompt, FORCED, forced_tokens=forced)
    hot = sampler.sample(prompt, dataclasses.replace(FORCED, temperature=0.5), forced_tokens=forced)
    logits = np.asarray(model.logits(_last_hidden(sampler, prompt)))[0] / 0.5
    expect = logits[forced[:, 0]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    np.testing.assert_allclose(hot.logprobs[:, 0], expect, rtol=0, atol=1e-5)
    assert not np.allclose(hot.logprobs, base.logprobs)


def test_greedy_matches_hf_generate(hf_model, sampler):
    prompt = _prompt(LONG, seed=5)  # longer than index_topk
    n = GREEDY.max_new_tokens
    # An explicit attention mask: HF would otherwise treat prompt tokens equal to pad_token_id as padding.
    gen_cfg = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=6)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, LONG, dtype=torch.long),
                                generation_config=gen_cfg)[0, LONG:].numpy()
    assert len(ref) == n
    res = sampler.sample(prompt, GREEDY)
    assert res.tokens[0].tolist() == ref.tolist()
    assert res.finish_reasons == [FINISH_LENGTH]


def test_prefix_reuse_is_bit_identical_to_cold(sampler):
    shared = _prompt(48, seed=6)
    first = shared + _prompt(13, seed=7)  # three whole 16-token chunks shared, then a 13-token tail
    second = shared + _prompt(13, seed=8)
    params = dataclasses.replace(SAMPLED, seed=11)
    cold = sampler.sample(second, params)
    assert cold.prefix_hit_tokens == 0
    sampler.prefix_cache.clear()
    warm_sampler = sampler
    warm_sampler.sample(first, params)
    calls = warm_sampler.prefill_calls
    warm = warm_sampler.sample(second, params)
    assert warm.prefix_hit_tokens == 48  # three whole 16-token chunks of the shared prefix
    assert warm_sampler.prefill_calls - calls == 1  # only the tail chunk was computed
    np.testing.assert_array_equal(warm.tokens, cold.tokens)
    np.testing.assert_array_equal(warm.logprobs, cold.logprobs)


def test_whole_prompt_prefill_matches_chunked(model, sampler):
    """`prefill_mode="whole"`: one uncached forward that also emits the cache (3 full + shared
    layers, prompt 45 > index_topk) equals the chunked prefill; a warm prompt continues in chunks."""
    whole = Sampler(model, chunk_size=16, capacity_multiple=64, prefill_mode="whole")
    prompt = _prompt(LONG, seed=12)
    want_cache, want_h, _ = sampler.prefill(prompt, 64)
    cache, h_last, hit = whole.prefill(prompt, 64)
    assert hit == 0 and whole.prefill_calls == 1 and int(cache.length) == LONG
    np.testing.assert_allclose(np.asarray(h_last), np.asarray(want_h), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.asarray(cache.c_kv[0])[..., LONG:, :].any()  # unused slots stay empty
    forced = _forced(4)
    ref = sampler.sample(prompt, FORCED, forced_tokens=forced)
    whole.prefix_cache.clear()
    got = whole.sample(prompt, FORCED, forced_tokens=forced)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    # A prompt sharing 32 tokens (two whole chunks) reuses them and runs only its tail chunk.
    calls = whole.prefill_calls
    warm = whole.sample(prompt[:40] + _prompt(LONG - 40, seed=13), SAMPLED)
    assert warm.prefix_hit_tokens == 32 and whole.prefill_calls - calls == 1
    with pytest.raises(ValueError, match="prefill_mode"):
        Sampler(model, prefill_mode="stream")
    with pytest.raises(ValueError, match="capacity 40 must hold the 45 prompt tokens"):
        model.prefill(jnp.asarray(prompt, jnp.int32)[None], 40)


@pytest.mark.parametrize("mode", ["chunked", "whole"])
def test_the_same_prompt_again_runs_no_prefill(model, sampler, mode):
    """Two requests on one prompt (two candidates, or the update's prompt KV after sampling): one prefill.
    The second reuses the whole stored cache and the last token's hidden state, and samples exactly what
    a cold request samples."""
    s = sampler if mode == "chunked" else Sampler(model, chunk_size=16, capacity_multiple=64, prefill_mode="whole")
    prompt = _prompt(LONG, seed=21)
    before = s.prefill_calls
    first = s.sample(prompt, SAMPLED)
    calls = s.prefill_calls
    second = s.sample(prompt, SAMPLED)
    cache, _, hit = s.prefill(prompt, s.capacity_for(LONG, SAMPLED.max_new_tokens))
    assert s.prefill_calls == calls and second.prefix_hit_tokens == hit == LONG and int(cache.length) == LONG
    assert first.prefix_hit_tokens == 0 and calls - before == (1 if mode == "whole" else 3)  # 16 + 16 + 13 tokens
    np.testing.assert_array_equal(second.tokens, first.tokens)
    np.testing.assert_array_equal(second.logprobs, first.logprobs)


def test_prefix_cache_is_bounded(model, sampler):
    one = model.init_cache(1, 64).nbytes()
    sampler.prefix_cache = PrefixCache(max_bytes=2 * one)
    for seed in range(4):
        sampler.sample(_prompt(SHORT, seed=100 + seed), GREEDY)
    assert len(sampler.prefix_cache) == 2 and sampler.prefix_cache.nbytes <= 2 * one
    assert sampler.prefix_cache.evictions == 2


def test_sampling_changes_no_parameter(model, sampler):
    before = param_inventory(model)
    sampler.sample(_prompt(SHORT), SAMPLED)
    assert param_inventory(model) == before


def test_seeds(sampler):
    prompt = _prompt(SHORT)
    a = sampler.sample(prompt, SAMPLED)
    b = sampler.sample(prompt, SAMPLED)
    c = sampler.sample(prompt, dataclasses.replace(SAMPLED, seed=2))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert len({tuple(r) for r in a.tokens}) == 4  # samples within a request differ too


def test_decode_progress_reports_every_step_and_changes_no_sample(model, sampler):
    """The decode loop is one compiled scan: its progress comes from a host callback per step, which must not
    change what is sampled."""
    seen = []
    reporting = Sampler(model, chunk_size=16, capacity_multiple=64, decode_progress=lambda d, n: seen.append((d, n)))
    prompt = _prompt(SHORT)
    with_progress = reporting.sample(prompt, SAMPLED)
    plain = sampler.sample(prompt, SAMPLED)
    np.testing.assert_array_equal(with_progress.tokens, plain.tokens)
    np.testing.assert_array_equal(with_progress.logprobs, plain.logprobs)
    jax.effects_barrier()  # unordered callbacks: every one has run after the barrier
    n = SAMPLED.max_new_tokens
    assert sorted(seen) == [(d, n) for d in range(1, n + 1)]


def test_first_token_distribution_and_truncation(model, sampler):
    """512 one-token samples follow softmax(logits / T) restricted to the top-p nucleus."""
    prompt = _prompt(SHORT)
    temperature, top_p, n = 0.2, 0.9, 512
    res = sampler.sample(prompt, SamplingParams(max_new_tokens=1, num_samples=n, temperature=temperature,
                                                top_p=top_p, seed=3))
    logits = np.asarray(model.logits(_last_hidden(sampler, prompt)))[0] / temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = order[before < top_p]
    assert 2 <= len(nucleus) <= 64, len(nucleus)  # a real truncation of the 512-token vocabulary
    assert set(res.tokens[:, 0].tolist()) <= set(nucleus.tolist())
    expect = probs[nucleus] / probs[nucleus].sum()
    counts = np.array([(res.tokens[:, 0] == t).sum() for t in nucleus])
    # Each nucleus token's count within 5 binomial standard deviations of its expectation.
    assert np.all(np.abs(counts - n * expect) <= 5 * np.sqrt(n * expect * (1 - expect)) + 1)
    top1 = sampler.sample(prompt, SamplingParams(max_new_tokens=1, num_samples=16, top_k=1, seed=4))
    assert set(top1.tokens[:, 0].tolist()) == {int(order[0])}


def test_stop_tokens_end_samples(sampler):
    prompt = _prompt(SHORT)
    greedy = sampler.sample(prompt, GREEDY)
    stop = int(greedy.tokens[0, 2])
    first = greedy.tokens[0].tolist().index(stop)
    res = sampler.sample(prompt, dataclasses.replace(GREEDY, stop_token_ids=(stop,)))
    assert res.finish_reasons == [FINISH_STOP]
    assert res.lengths[0] == first + 1
    assert res.tokens[0, first + 1:].tolist() == [PAD_TOKEN] * (GREEDY.max_new_tokens - 1 - first)
    assert (res.logprobs[0, first + 1:] == 0).all()
    np.testing.assert_array_equal(res.tokens[0, :first + 1], greedy.tokens[0, :first + 1])


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 2, 512], SamplingParams(), "outside the vocabulary"),
    ([1, -3], SamplingParams(), "outside the vocabulary"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p must be in"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p must be in"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([1, 2], SamplingParams(num_samples=0), "num_samples"),
    ([1, 2], SamplingParams(top_k=-1), "top_k"),
    ([1, 2], SamplingParams(stop_token_ids=(600,)), "stop_token_ids"),
    ([1] * 65530, SamplingParams(max_new_tokens=10), "exceeds the position capacity"),
])
def test_bad_input_fails_before_compute(sampler, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        sampler.sample(prompt, params)
    assert sampler.prefill_calls == 0
