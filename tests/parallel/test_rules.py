"""Logical axis rules and running the model under meshes (1 device, orthogonal, folded)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import glm52_jax
from glm52_jax import config
from glm52_jax.parallel import rules

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8)


def test_logical_to_spec():
    table = (("batch", "data"), ("seq", "context"), ("experts", "expert"), ("folded", ("context", "expert")))
    assert rules.logical_to_spec(("batch", "seq", "embed"), table) == P("data", "context", None)
    # A mesh axis is claimed once per array; absent mesh axes are dropped.
    assert rules.logical_to_spec(("seq", "seq"), table) == P("context", None)
    assert rules.logical_to_spec(("experts", "seq"), table, mesh_axes=("context",)) == P(None, "context")
    assert rules.logical_to_spec(("folded",), table) == P(("context", "expert"))


def test_constrain_rejects_wrong_rank():
    mesh = jax.make_mesh((1,), ("context",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="2 axis names"):
        jax.jit(lambda x: rules.constrain(x, ("batch", "seq")))(jnp.zeros((2, 3, 4)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = config.tiny()
    model = glm52_jax.GlmMoeDsa(cfg, OPTS, rngs=nnx.Rngs(0))
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    glm52_jax.save_pretrained(model, path)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 48)), jnp.int32)
    return path, ids, np.asarray(model(ids))


def _run_on_mesh(path, ids, mesh, table):
    with rules.axis_rules(table):
        model = glm52_jax.load_pretrained(path, dtype=jnp.float32, shardings=mesh, options=OPTS)
        graphdef, state = nnx.split(model)
        fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
        with jax.set_mesh(mesh):
            spec = rules.logical_to_spec(("batch", "seq"), mesh_axes=mesh.axis_names)
            out = fn(state, jax.device_put(ids, jax.sharding.NamedSharding(mesh, spec)))
    return model, out


def test_one_device_mesh(saved):
    path, ids, ref = saved
    mesh = jax.make_mesh((1, 1, 1), ("data", "context", "expert"), axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:1])
    _, out = _run_on_mesh(path, ids, mesh, rules.DEFAULT_RULES)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_orthogonal_context4_expert2(saved):
    path, ids, ref = saved
    mesh = jax.make_mesh((1, 4, 2), ("data", "context", "expert"), axis_types=(AxisType.Auto,) * 3)
    model, out = _run_on_mesh(path, ids, mesh, rules.DEFAULT_RULES)
    w_gate = model.stacks[1].layers[0].mlp.w_gate[...]
    assert w_gate.sharding.spec == P(None, "expert", None, None)
    assert out.sharding.spec[1] == "context"
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_folded_context_and_experts_on_one_axis(saved):
    """The seed's layout: one 8-way axis shards the sequence in attention and the experts in the MoE."""
    path, ids, ref = saved
    mesh = jax.make_mesh((8,), ("cp_ep",), axis_types=(AxisType.Auto,))
    table = (("seq", "cp_ep"), ("experts", "cp_ep"))
    model, out = _run_on_mesh(path, ids, mesh, table)
    assert model.stacks[1].layers[0].mlp.w_gate[...].sharding.spec == P(None, "cp_ep", None, None)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


# ~40 s; the sampler's cache sharding is checked in CI by tests/parallel/test_sharded_rl.py (cache tests)
@pytest.mark.slow
def test_cache_sequence_axis_stays_sharded(saved):
    """Two cached chunks under context 4 x expert 2: the written cache is split along its sequence
    axis (16 of 64 slots per device; the second chunk lands on another shard) and holds exactly
    what the single-device run writes."""
    path, ids, _ = saved
    mesh = jax.make_mesh((1, 4, 2), ("data", "context", "expert"), axis_types=(AxisType.Auto,) * 3)
    model = glm52_jax.load_pretrained(path, dtype=jnp.float32, options=OPTS)
    graphdef, state = nnx.split(model)

    def two_chunks(st, x):
        m = nnx.merge(graphdef, st)
        h1, cache = m.forward_cached(x[:, :16], m.init_cache(1, 64))
        h2, cache = m.forward_cached(x[:, 16:28], cache)
        return h2, cache

    want_h, want = jax.jit(two_chunks)(state, ids[:1])
    with jax.set_mesh(mesh):
        got_h, cache = jax.jit(two_chunks)(state, ids[:1])
    for stack, ref in zip((*cache.c_kv, *cache.k_rope, *cache.index_k), (*want.c_kv, *want.k_rope, *want.index_k)):
        assert stack.sharding.spec[3] == "context", stack.sharding.spec
        assert {s.data.shape[3] for s in stack.addressable_shards} == {16}  # 64 slots / 4
        np.testing.assert_allclose(np.asarray(stack), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert int(cache.length) == 28
    np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), rtol=1e-5, atol=1e-5)


def test_weight_spec_shards_the_largest_free_dimension_over_the_unused_fsdp_axes():
    folded = jax.sharding.AbstractMesh((1, 8, 1), ("data", "cp_ep", "tensor"))
    table = (("experts", "cp_ep"), ("heads", "tensor"), (rules.FSDP, ("data", "cp_ep", "tensor")))
    # Only the axes of size > 1 shard (cp_ep); the largest dimension it divides wins, never the stacked 'layers'.
    assert rules.weight_spec(("layers", "embed", "q_lora"), (16, 64, 48), folded, table) == P(None, "cp_ep", None)
    assert rules.weight_spec(("layers", "q_lora", "heads", "qk_dim"), (16, 48, 4, 40), folded, table) == \
        P(None, "cp_ep", "tensor", None)  # the (1-wide) tensor axis its rules give 'heads' kept
    assert rules.weight_spec(("embed",), (20,), folded, table) == P(None)  # 8 divides no dimension: replicated
    # A weight its own rules already shard over cp_ep (the routed experts) is left as it is.
    assert rules.weight_spec(("layers", "experts", "embed", "expert_mlp"), (2, 8, 64, 32), folded, table) == \
        P(None, "cp_ep", None, None)
    # Without an FSDP entry a weight gets its logical spec.
    assert rules.weight_spec(("embed", "q_lora"), (64, 48), folded, table[:2]) == P(None, None)
    # Orthogonal context 4 x expert 2: both axes together; the tensor axis of a tensor-parallel weight kept.
    ortho = jax.sharding.AbstractMesh((4, 2, 2), ("context", "expert", "tensor"))
    table = (("heads", "tensor"), (rules.FSDP, ("context", "expert", "tensor")))
    assert rules.weight_spec(("kv_lora", "heads", "v_dim"), (32, 4, 32), ortho, table) == \
        P(("context", "expert"), "tensor", None)
    assert rules.weight_spec(("vocab", "embed"), (512, 64), ortho, table) == P(("context", "expert", "tensor"), None)
