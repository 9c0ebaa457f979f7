"""Gradient modes: conventional, response_only and shared_prefix on a tiny float32 model with LoRA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lora_utils import fast_rngs, with_random_b

import glm52_jax
from glm52_jax import config
from glm52_jax.model.lora import FAMILIES, LoRA, LoRAConfig
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.rl import grpo
from glm52_jax.rl.gradients import MODES, LossSettings, _normalisers, lora_gradients, prefix_capacity, sample_loss

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0))
# tiny() cut to 4 layers (dense+full, MoE+full, 2 x MoE+shared stacked in one scan) to keep compiles short.
CFG = config.tiny(num_hidden_layers=4, indexer_types=("full", "full", "shared", "shared"))
P, G, R = 40, 2, 6  # prompt longer than index_topk (32), so the prefix's top-k really selects
CHUNK = 4  # logits in 2 chunks; also a jit cache key no other test file uses (see `runs`)


@pytest.fixture(scope="module")
def model():
    return with_random_b(GlmMoeDsa(CFG, OPTS, rngs=fast_rngs()))


@pytest.fixture(scope="module")
def batch(model):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 512, P).astype(np.int32)
    responses = rng.integers(0, 512, (G, R)).astype(np.int32)
    mask = np.ones((G, R), np.float32)
    mask[1, 4:] = 0  # sample 1 stopped early
    advantages = np.array([1.0, -0.7], np.float32)  # both signs
    return dict(prompt=prompt, responses=responses, response_mask=mask, advantages=advantages)


@pytest.fixture(scope="module")
def runs(model, batch):
    """Every mode once, with old log-probs near the new ones (ratio != 1, some tokens clipped).

    Each chunk the model processes is counted at run time (a debug callback around
    `GlmMoeDsa._run`), so the counts say how many times the prompt really ran.
    """
    calls = []
    original = GlmMoeDsa._run

    def counted(self, input_ids, positions, cache, **kw):
        seq = input_ids.shape[-1]
        jax.debug.callback(lambda: calls.append(seq))
        return original(self, input_ids, positions, cache, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GlmMoeDsa, "_run", counted)
        first = lora_gradients(model, **batch, old_logprobs=np.zeros((G, R), np.float32), mode="conventional",
                               logprob_chunk=CHUNK)
        noise = np.random.default_rng(1).normal(0.0, 0.3, (G, R)).astype(np.float32)
        old = np.asarray(first.logprobs) + noise
        out, counts = {}, {}
        for mode in MODES:
            calls.clear()
            out[mode] = lora_gradients(model, **batch, old_logprobs=old, mode=mode, logprob_chunk=CHUNK)
            jax.block_until_ready(out[mode].grads)
            counts[mode] = sorted(calls)
    return out, counts, old


def _family_vectors(result, model):
    families = {p: v.get_metadata()["family"] for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    vecs = {f: [] for f in FAMILIES}
    for path, g in nnx.to_flat_state(result.grads):
        vecs[families[path]].append(np.asarray(g.get_value(), np.float64).ravel())
    vecs = {f: np.concatenate(v) for f, v in vecs.items()}
    vecs["all"] = np.concatenate([vecs[f] for f in FAMILIES])
    return vecs


def _compare(a, b):
    """(relative L2 of a against b, cosine) per family."""
    va, vb = a, b
    return {f: (np.linalg.norm(va[f] - vb[f]) / np.linalg.norm(vb[f]),
                va[f] @ vb[f] / (np.linalg.norm(va[f]) * np.linalg.norm(vb[f]))) for f in vb}


def _report(name, stats):
    print(f"\n{name} vs conventional:")
    for f, (rel, cos) in stats.items():
        print(f"  {f:15s} rel-L2 {rel:.3e}  cosine {cos:.9f}")


def test_every_family_gets_gradient(runs, model):
    vecs = _family_vectors(runs[0]["conventional"], model)
    for f in FAMILIES:
        assert np.linalg.norm(vecs[f]) > 1e-4, f


def test_modes_agree_on_logprobs_and_loss(runs, batch):
    out, _, old = runs
    ref = out["conventional"]
    assert float(ref.metrics["clipfrac"]) > 0, "the test should exercise clipping"
    for mode in MODES:
        r = out[mode]
        assert r.logprobs.shape == (G, R) and r.sample_losses.shape == (G,)
        np.testing.assert_allclose(np.asarray(r.logprobs), np.asarray(ref.logprobs), rtol=0, atol=1e-6)
        assert abs(float(r.loss) - float(ref.loss)) <= 1e-6, mode
        # The per-sample shares sum to the batch loss computed in one piece.
        assert abs(float(r.loss) - float(r.metrics["pg_loss"])) <= 1e-6, mode
        batch_loss, _ = grpo.policy_loss(r.logprobs, jnp.asarray(old), jnp.asarray(batch["advantages"]),
                                         jnp.asarray(batch["response_mask"]))
        assert abs(float(r.loss) - float(batch_loss)) <= 1e-6, mode


def test_shared_prefix_equals_conventional(runs, model):
    out = runs[0]
    stats = _compare(_family_vectors(out["shared_prefix"], model), _family_vectors(out["conventional"], model))
    _report("shared_prefix", stats)
    for f, (rel, cos) in stats.items():
        assert rel <= 1e-5 and cos >= 0.999999, (f, rel, cos)


def test_response_only_drops_only_the_prefix_gradient(runs, model):
    out = runs[0]
    stats = _compare(_family_vectors(out["response_only"], model), _family_vectors(out["conventional"], model))
    _report("response_only", stats)
    # The unembed sees only response positions: nothing flows through the prefix to it.
    assert stats["unembed"][0] <= 1e-6, stats["unembed"]
    # Every other family also acts on the prompt, whose KV the response attends to: that part is dropped.
    for f in ("attention", "routed_experts", "shared_expert", "dense_mlp"):
        assert stats[f][0] > 1e-3, (f, stats[f])
    # Still a descent direction for the full objective (how close depends on the model: a random tiny
    # model with a 39-token prefix and 6-token responses routes most of its gradient through the prefix).
    assert stats["all"][1] > 0, stats["all"]


def test_prompt_runs_once_in_shared_prefix(runs):
    counts = runs[1]
    assert counts["conventional"] == [P + R - 1] * G  # the prompt runs G times
    assert counts["shared_prefix"] == sorted([P - 1] + [R] * G), counts  # once, plus G response chunks
    assert counts["response_only"] == sorted([P - 1] + [R] * G), counts


def test_response_only_with_the_samplers_prefix_cache(model, batch, runs):
    out, _, old = runs
    # As a sampler leaves it: the whole prompt prefilled (length P > P-1, the last slot gets rewritten),
    # in a cache of the capacity response_only's own prefill uses (256 slots, as the sampler's), so
    # the gradient program compiled for `runs` is reused.
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda s, ids, c: nnx.merge(graphdef, s).forward_cached(ids, c)[1])
    capacity = prefix_capacity(P, R)
    assert capacity >= P - 1 + R
    cache = prefill(state, jnp.asarray(batch["prompt"])[None], model.init_cache(1, capacity))
    assert int(cache.length) == P
    given = lora_gradients(model, **batch, old_logprobs=old, mode="response_only", prefix_cache=cache,
                           logprob_chunk=CHUNK)
    own = out["response_only"]
    np.testing.assert_allclose(np.asarray(given.logprobs), np.asarray(own.logprobs), rtol=0, atol=1e-6)
    stats = _compare(_family_vectors(given, model), _family_vectors(own, model))
    for f, (rel, cos) in stats.items():
        assert rel <= 1e-5 and cos >= 0.999999, (f, rel, cos)


@pytest.mark.parametrize("mode", grpo.LOSS_AGG_MODES)
def test_sample_losses_sum_to_batch_loss(mode):
    rng = np.random.default_rng(2)
    logp = jnp.asarray(rng.normal(-2, 0.5, (3, 5)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.3, (3, 5)), jnp.float32)
    adv = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], jnp.float32)
    settings = LossSettings(loss_agg_mode=mode)
    norm = _normalisers(mask, settings)
    total = sum(sample_loss(logp[i], old[i], adv[i], mask[i], settings, norm) for i in range(3))
    ref, _ = grpo.policy_loss(logp, old, adv, mask, loss_agg_mode=mode)
    np.testing.assert_allclose(float(total), float(ref), rtol=1e-6, atol=1e-7)


def test_input_errors(model, batch):
    old = np.zeros((G, R), np.float32)
    with pytest.raises(ValueError, match="mode"):
        lora_gradients(model, **batch, old_logprobs=old, mode="exact")
    with pytest.raises(ValueError, match="old_logprobs"):
        lora_gradients(model, **batch, old_logprobs=old[:, :3], mode="conventional")
    with pytest.raises(ValueError, match="only used by response_only"):
        lora_gradients(model, **batch, old_logprobs=old, mode="shared_prefix", prefix_cache=model.init_cache(1, 64))
    with pytest.raises(ValueError, match="fewer than"):
        lora_gradients(model, **batch, old_logprobs=old, mode="response_only", prefix_cache=model.init_cache(1, 64))
    base = nnx.eval_shape(lambda: GlmMoeDsa(CFG, dataclasses.replace(OPTS, lora=None), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="no LoRA"):
        lora_gradients(base, **batch, old_logprobs=old, mode="conventional")
