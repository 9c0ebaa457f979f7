"""Model assembly: layer stacking plan, dtypes, logical axes, jit, and memory shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_utils import largest_intermediate

import glm52_jax
from glm52_jax import config
from glm52_jax.model.transformer import GlmMoeDsa, Segment, layer_kinds, plan_segments

F32 = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                             attention_query_block=8)


def test_glm52_plan_is_three_scans():
    plan = plan_segments(layer_kinds(config.glm52()))
    shared, full = ("sparse", "shared"), ("sparse", "full")
    assert plan == [Segment(0, (("dense", "full"),), 3), Segment(3, (shared, shared, shared, full), 18),
                    Segment(75, (shared,), 3)]


@pytest.mark.parametrize("seed", range(20))
def test_plan_covers_every_layer_in_order(seed):
    rng = np.random.default_rng(seed)
    kinds = [("dense", "full")] + [(str(rng.choice(["dense", "sparse"])), str(rng.choice(["full", "shared"])))
                                   for _ in range(rng.integers(0, 30))]
    rebuilt = [k for seg in plan_segments(kinds) for _ in range(seg.repeats) for k in seg.unit]
    assert rebuilt == kinds


def _rngs():
    """rbg keys: their random draws compile fast on XLA:CPU (eager init compiles every op once)."""
    return nnx.Rngs(jax.random.key(0, impl="rbg"))


@pytest.fixture(scope="module")
def tiny_f32():
    return GlmMoeDsa(config.tiny(), F32, rngs=_rngs())


@pytest.fixture(scope="module")
def tiny_bf16():
    """The default options (bf16 parameters); the same init keys as `tiny_f32`."""
    return GlmMoeDsa(config.tiny(), rngs=_rngs())


@pytest.fixture(scope="module")
def ids():
    """[2,33] tokens, longer than index_topk (32); every forward test uses this one shape."""
    return jnp.asarray(np.random.default_rng(2).integers(0, 512, (2, 33)), jnp.int32)


@pytest.fixture(scope="module")
def eager_logits(tiny_f32, ids):
    """Op-by-op (un-jitted) logits of `ids`."""
    return np.asarray(tiny_f32(ids))


def _jitted_logits(model, ids):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))(state, ids))


def test_every_param_has_logical_axes(tiny_f32):
    _, state = nnx.split(tiny_f32)
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var.get_value().ndim, path
        assert (axes[0] == "layers") == (path[0] == "stacks"), path


def test_default_dtypes_bf16_with_fp32_router_and_weights_proj(tiny_bf16, ids):
    _, state = nnx.split(tiny_bf16)
    fp32 = {"router", "e_score_correction_bias", "weights_proj"}
    for path, var in nnx.to_flat_state(state):
        expect = jnp.float32 if path[-1] in fp32 else jnp.bfloat16
        assert var.get_value().dtype == expect, path
    logits = _jitted_logits(tiny_bf16, ids)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


def test_bf16_tracks_float32(tiny_f32, tiny_bf16, ids, eager_logits):
    _, state = nnx.split(tiny_f32)
    graphdef_bf16, state_bf16 = nnx.split(tiny_bf16)
    # Same weights, rounded to the bf16 model's dtypes.
    cast = jax.tree.map(lambda a, b: a.astype(b.dtype), state, state_bf16)
    ours = _jitted_logits(nnx.merge(graphdef_bf16, cast), ids)
    rel = np.linalg.norm(ours - eager_logits) / np.linalg.norm(eager_logits)
    assert 0 < rel < 0.05, rel


def test_jit_matches_eager(tiny_f32, ids, eager_logits):
    np.testing.assert_allclose(_jitted_logits(tiny_f32, ids), eager_logits, rtol=1e-5, atol=1e-5)


def test_whole_model_has_no_sequence_squared_array():
    seq = 4096
    model = nnx.eval_shape(lambda: GlmMoeDsa(config.tiny(index_topk=64), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    biggest = largest_intermediate(jax.make_jaxpr(lambda st, x: nnx.merge(graphdef, st).hidden_states(x))(state, ids))
    assert biggest < seq * seq // 8, biggest


def test_token_logprobs_shape_and_normalisation(tiny_f32, ids, eager_logits):
    lp = glm52_jax.token_logprobs(tiny_f32, ids, chunk=4)  # 32 targets in 8 chunks
    ref = jnp.take_along_axis(jax.nn.log_softmax(eager_logits[:, :-1], -1), ids[:, 1:, None], -1)[..., 0]
    assert lp.shape == (2, 32)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref), atol=1e-5)


def test_bad_input_rank_is_rejected(tiny_f32):
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        tiny_f32(jnp.zeros((5,), jnp.int32))
