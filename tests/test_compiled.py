"""The compiled public entry points: the op-by-op values, one trace per model structure and shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm52_jax
from glm52_jax import compiled, config
from glm52_jax.config import derive_indexer_types
from glm52_jax.model import transformer
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.model.transformer import token_logprobs as eager_token_logprobs


@pytest.fixture(scope="module")
def model():
    """A dense and a MoE layer (every op kind of the forward); rbg keys compile fast on XLA:CPU."""
    cfg = config.tiny(num_hidden_layers=2, indexer_types=derive_indexer_types(2, freq=2, offset=2))
    return GlmMoeDsa(cfg, ModelOptions(param_dtype=jnp.float32), rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))


@pytest.fixture(scope="module")
def ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 24)), jnp.int32)


@pytest.fixture(scope="module")
def eager(model, ids):
    """[2,23] next-token log-probs computed op by op (what the export ran before)."""
    return np.asarray(eager_token_logprobs(model, ids, chunk=8))


def test_exports_are_the_compiled_entry_points():
    assert glm52_jax.token_logprobs is compiled.token_logprobs and glm52_jax.forward is compiled.forward


def test_token_logprobs_compiles_once_and_matches_eager(model, ids, eager):
    before = compiled.TRACES["token_logprobs"]
    first = np.asarray(glm52_jax.token_logprobs(model, ids, chunk=8))
    second = np.asarray(glm52_jax.token_logprobs(model, ids, chunk=8))
    assert compiled.TRACES["token_logprobs"] == before + 1  # the repeat call reused the program
    assert first.shape == (2, 23) and np.array_equal(first, second)
    np.testing.assert_allclose(first, eager, rtol=1e-5, atol=1e-5)
    # New weights of the same structure (what an optimizer step produces) reuse it; the values follow them.
    moved = nnx.clone(model)
    nnx.update(moved, jax.tree.map(lambda x: x * 1.5 if x.dtype == jnp.float32 else x, nnx.state(moved, nnx.Param)))
    shifted = np.asarray(glm52_jax.token_logprobs(moved, ids, chunk=8))
    assert compiled.TRACES["token_logprobs"] == before + 1
    assert np.abs(shifted - first).max() > 1e-3
    glm52_jax.token_logprobs(model, ids[:, :16], chunk=8)  # another length: one more program
    assert compiled.TRACES["token_logprobs"] == before + 2


def test_forward_compiles_once_and_matches_eager(model, ids, eager):
    before = transformer.COMPILED_TRACES[0]
    got = [np.asarray(glm52_jax.forward(model, ids)), np.asarray(model(ids))]  # a direct call: the same program
    assert transformer.COMPILED_TRACES[0] == before + 1
    assert got[0].shape == (2, 24, 512) and np.array_equal(got[0], got[1])
    # The logits' next-token log-probs are the op-by-op ones.
    logp = jax.nn.log_softmax(got[0][:, :-1], axis=-1)
    np.testing.assert_allclose(np.take_along_axis(logp, np.asarray(ids)[:, 1:, None], -1)[..., 0], eager,
                               rtol=1e-5, atol=1e-5)


def test_a_direct_call_inside_a_transform_traces_inline(model, ids):
    """Under jit the weights and ids are tracers: `model(ids)` is part of the caller's program, not a nested
    compiled one, and gradients flow through it."""
    graphdef, state = nnx.split(model)
    before = transformer.COMPILED_TRACES[0]
    loss = jax.jit(jax.grad(lambda st: nnx.merge(graphdef, st)(ids).mean()))(state)
    assert transformer.COMPILED_TRACES[0] == before
    assert float(jnp.abs(loss["embed_tokens"][...]).max()) > 0
