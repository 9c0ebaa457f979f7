"""model/shared_cache.py: G rows decoded against one batch-1 prompt cache plus per-row suffixes equal the
broadcast layout (the prompt cache copied to G rows, each token run by `forward_cached`), on one device
and on an 8-device mesh that shards the prompt's slots.

The reference is the sampler's decode loop as it was before the shared layout (greedy, kept here). The
rows start from different hidden states, so their tokens and suffixes differ. float32 tiny model (a dense
full-indexer layer, then a MoE layer sharing its top-k); P = 45 > index_topk = 32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lora_utils import fast_rngs

import glm52_jax
from glm52_jax import config
from glm52_jax.model.kv_cache import KVCache
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import axis_rules
from glm52_jax.rollout import sampler

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8)
CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
P, G, N, CAPACITY = 45, 3, 5, 64


def _broadcast_decode(graphdef, state, prompt: KVCache, h_last):
    """The old layout: the prompt cache repeated to G rows, N greedy steps of `forward_cached`."""
    model = nnx.merge(graphdef, state)
    cache = jax.tree.map(lambda a: jnp.repeat(a, G, axis=2) if a.ndim else a, prompt)

    def step(carry, _):
        cache, h = carry
        logits = model.logits(h)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[:, 0]
        h, cache = model.forward_cached(token[:, None], cache)
        return (cache, h[:, 0]), (token, logp)

    (cache, _), (tokens, logps) = jax.lax.scan(step, (cache, h_last), None, length=N)
    return tokens.T, logps.T, cache


def _shared_decode(graphdef, state, prompt: KVCache, h_last):
    model = nnx.merge(graphdef, state)
    return sampler.decode_steps(model, prompt, model.init_suffix(G, N), h_last, None, None, steps=N,
                                temperature=0.0, top_k=0, top_p=1.0, stop_ids=())


def _prompt_cache(graphdef, state):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (1, P)), jnp.int32)
    model = nnx.merge(graphdef, state)
    return model.forward_cached(ids, model.init_cache(1, CAPACITY))[1]


@pytest.fixture(scope="module")
def model():
    return GlmMoeDsa(CFG, OPTS, rngs=fast_rngs())


def _run(model, spec):
    h_last = jnp.asarray(np.random.default_rng(1).normal(size=(G, CFG.hidden_size)), jnp.float32)
    if spec is None:
        graphdef, state = nnx.split(model)
        prompt = jax.jit(_prompt_cache, static_argnums=0)(graphdef, state)
        return (jax.jit(_broadcast_decode, static_argnums=0)(graphdef, state, prompt, h_last),
                jax.jit(_shared_decode, static_argnums=0)(graphdef, state, prompt, h_last), prompt, None)
    mesh_spec = parse_mesh(spec)
    mesh = mesh_spec.make()
    with axis_rules(mesh_spec.rules()):
        graphdef, state = nnx.split(place_model(model, mesh))
        with jax.set_mesh(mesh):
            prompt = jax.jit(_prompt_cache, static_argnums=0)(graphdef, state)
            want = jax.jit(_broadcast_decode, static_argnums=0)(graphdef, state, prompt, h_last)
            got = jax.jit(_shared_decode, static_argnums=0)(graphdef, state, prompt, h_last)
            jaxpr = str(jax.make_jaxpr(_shared_decode, static_argnums=0)(graphdef, state, prompt, h_last))
    return want, got, prompt, jaxpr


# CI runs one device (the equivalence) and the sharded decode is in CI through tests/parallel/test_sharded_rl.py;
# the meshes here are `slow` (CI budget).
@pytest.mark.parametrize("spec", [None, pytest.param("context=4,expert=2", marks=pytest.mark.slow),
                                  pytest.param("folded=8", marks=pytest.mark.slow)])
def test_shared_prompt_decode_equals_the_broadcast_layout(model, spec):
    (want_tokens, want_logps, want_cache), (tokens, logps, suffix), prompt, jaxpr = _run(model, spec)
    tokens, want_tokens = np.asarray(tokens), np.asarray(want_tokens)
    assert len({tuple(row) for row in want_tokens}) == G  # the rows differ: each has its own suffix
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(np.asarray(logps), np.asarray(want_logps), rtol=0, atol=1e-6)
    # The suffix holds what the broadcast cache holds in slots P .. P+N-1, row by row; the prompt is untouched.
    assert int(suffix.length) == N and int(prompt.length) == P and int(want_cache.length) == P + N
    want_cache = want_cache.relayout(1)  # slot order (strided over the slot shards on a mesh)
    for got, full in zip(jax.tree.leaves((suffix.c_kv, suffix.k_rope, suffix.index_k)),
                         jax.tree.leaves((want_cache.c_kv, want_cache.k_rope, want_cache.index_k))):
        assert got.shape == (*full.shape[:3], N, full.shape[4])
        np.testing.assert_allclose(np.asarray(got), np.asarray(full)[:, :, :, P:P + N], rtol=0, atol=1e-6)
    if spec is not None:
        # Prompt slots scored and attended where they live: local candidates all-gathered, LSE combine.
        assert "all_gather" in jaxpr and "pmax" in jaxpr
        ways = 4 if spec.startswith("context") else 8
        for stack in (*prompt.c_kv, *prompt.k_rope):
            assert {s.data.shape[3] for s in stack.addressable_shards} == {CAPACITY // ways}
        for stack in (*suffix.c_kv, *suffix.k_rope):  # small: replicated over the slot shards
            assert {s.data.shape[2:4] for s in stack.addressable_shards} == {(G, N)}


def test_forward_shared_checks_its_caches(model):
    prompt = model.init_cache(2, 16)
    with pytest.raises(ValueError, match="batch-1 prompt cache and a suffix of 2 rows, got batch 2"):
        model.forward_shared(jnp.zeros((2, 1), jnp.int32), prompt, model.init_suffix(2, 4))
    suffix = model.init_suffix(2, 4)
    suffix.length = jnp.asarray(4, jnp.int32)
    with pytest.raises(ValueError, match=r"suffix overflow: 4 \+ 1 tokens > capacity 4"):
        model.forward_shared(jnp.zeros((2, 1), jnp.int32), model.init_cache(1, 16), suffix)
