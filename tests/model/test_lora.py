"""LoRA adapters: off by default, tagged, exact at B = 0, and equal to merged weights for every family."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm52_jax
from glm52_jax import config
from glm52_jax.model.lora import FAMILIES, RANK_AXIS, LoRA, LoRAConfig, attach_lora, merge_lora
from glm52_jax.model.transformer import GlmMoeDsa

F32 = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                             attention_query_block=8)
LORA = LoRAConfig(rank=4, alpha=8.0)
SEQ = 40  # longer than index_topk (32): the indexer's top-k really selects


def rbg(seed):
    """A key whose random draws compile fast on XLA:CPU (eager init compiles every op once)."""
    return jax.random.key(seed, impl="rbg")


def _ids(seed=0, seq=SEQ):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 512, (1, seq)), jnp.int32)


def _families(state: nnx.State) -> dict:
    return {path: var.get_metadata()["family"] for path, var in nnx.to_flat_state(state)}


def with_random_b(model, families, seed=0, std=0.05):
    """The model with every B of the given families random (others zero), A unchanged."""
    graphdef, params, lora = nnx.split(model, nnx.Param, LoRA)
    rng = np.random.default_rng(seed)  # numpy: no per-shape XLA compiles
    flat = []
    for path, var in nnx.to_flat_state(lora):
        value = np.asarray(var.get_value())
        if path[-1] in ("b", "b_k", "b_v"):
            hit = var.get_metadata()["family"] in families
            value = std * rng.standard_normal(value.shape) if hit else np.zeros_like(value)
        flat.append((path, var.replace(jnp.asarray(value, var.get_value().dtype))))
    return nnx.merge(graphdef, params, nnx.from_flat_state(flat))


@pytest.fixture(scope="module")
def lora_model():
    return GlmMoeDsa(config.tiny(), dataclasses.replace(F32, lora=LORA), rngs=nnx.Rngs(rbg(0), lora=rbg(1)))


@pytest.fixture(scope="module")
def base_model():
    return GlmMoeDsa(config.tiny(), F32, rngs=nnx.Rngs(rbg(0)))


@pytest.fixture(scope="module")
def forwards(lora_model):
    """Jitted logits of (a) the LoRA model given its adapter state, (b) a LoRA-free model given params."""
    ids = _ids()
    graphdef, params, _ = nnx.split(lora_model, nnx.Param, LoRA)
    lora_fwd = jax.jit(lambda lora: nnx.merge(graphdef, params, lora)(ids))
    base_graphdef = nnx.graphdef(merge_lora(lora_model))
    base_fwd = jax.jit(lambda p: nnx.merge(base_graphdef, p)(ids))
    return lora_fwd, base_fwd


def test_lora_is_off_by_default(base_model):
    assert glm52_jax.ModelOptions().lora is None
    assert not jax.tree.leaves(nnx.state(base_model, LoRA))
    assert base_model.lm_head_lora is None


def test_base_init_does_not_depend_on_lora(lora_model, base_model):
    # Adapters draw from the `lora` stream, so the base params match a LoRA-free model's bit for bit.
    ours = nnx.to_flat_state(nnx.state(lora_model, nnx.Param))
    base = nnx.to_flat_state(nnx.state(base_model))
    assert [p for p, _ in ours] == [p for p, _ in base]
    for (path, a), (_, b) in zip(ours, base):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


def test_adapters_are_tagged_and_initialised(lora_model):
    state = nnx.state(lora_model, LoRA)
    seen = set()
    for path, var in nnx.to_flat_state(state):
        meta, value = var.get_metadata(), np.asarray(var.get_value())
        axes = meta["out_sharding"]
        seen.add(meta["family"])
        assert meta["family"] in FAMILIES, path
        assert len(axes) == value.ndim and RANK_AXIS in axes, (path, axes)
        assert (axes[0] == "layers") == (path[0] == "stacks"), (path, axes)
        assert value.dtype == np.float32
        if path[-1] == "a":
            assert np.abs(value).max() > 0, path
        else:
            assert not value.any(), path
        if meta["family"] == "routed_experts":
            assert axes[1] == "experts" and value.shape[1] == config.tiny().n_routed_experts, (path, axes)
    assert seen == set(FAMILIES)
    # Distinct from nnx.Param: base-only code (checkpoint I/O) filters them out by type.
    assert not any(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(state))


def test_zero_b_reproduces_base_exactly(lora_model, base_model):
    # Op by op (no XLA fusion across the LoRA add), a zero B adds exact zeros everywhere. Every adapter
    # acts per token, so a short sequence (fewer un-jitted loop trips) covers them all.
    ids = _ids(1, seq=17)
    with jax.disable_jit():
        ours = np.asarray(lora_model(ids))
        ref = np.asarray(base_model(ids))
    np.testing.assert_array_equal(ours, ref)


def test_zero_b_compiled_matches_base(lora_model, forwards):
    # Compiled, XLA may fuse the (zero) add with its neighbours and round differently at ~1 ulp.
    lora_fwd, base_fwd = forwards
    ours = np.asarray(lora_fwd(nnx.state(lora_model, LoRA)))
    ref = np.asarray(base_fwd(nnx.state(lora_model, nnx.Param)))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("families", [(f,) for f in FAMILIES] + [FAMILIES], ids=list(FAMILIES) + ["all"])
def test_matches_merged_weights(lora_model, forwards, families):
    lora_fwd, base_fwd = forwards
    model = with_random_b(lora_model, families, seed=len(families[0]))
    ours = np.asarray(lora_fwd(nnx.state(model, LoRA)))
    merged = np.asarray(base_fwd(nnx.state(merge_lora(model))))
    base = np.asarray(base_fwd(nnx.state(lora_model, nnx.Param)))
    assert np.abs(ours - base).max() > 1e-3, "the adapters should change the logits"
    np.testing.assert_allclose(ours, merged, rtol=0, atol=1e-5)


def test_attach_lora_matches_constructor(base_model):
    # Two families keep the compile small (XLA:CPU compiles random draws slowly) yet cover both a
    # stacked, per-expert adapter and a global one.
    lora = LoRAConfig(rank=4, alpha=8.0, families=frozenset({"routed_experts", "unembed"}))
    built = GlmMoeDsa(config.tiny(), dataclasses.replace(F32, lora=lora), rngs=nnx.Rngs(rbg(0), lora=rbg(1)))
    attached = attach_lora(base_model, lora, seed=rbg(1))  # the constructor's `lora` stream key
    ours = nnx.to_flat_state(nnx.state(attached, LoRA))
    ref = nnx.to_flat_state(nnx.state(built, LoRA))
    assert {v.get_metadata()["family"] for _, v in ours} == lora.families
    assert [p for p, _ in ours] == [p for p, _ in ref]
    for (path, a), (_, b) in zip(ours, ref):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
        assert a.get_metadata() == b.get_metadata(), path
    assert attached.embed_tokens.get_value() is base_model.embed_tokens.get_value()  # base shared, not copied
    with pytest.raises(ValueError, match="already has LoRA"):
        attach_lora(attached, lora)


def test_checkpoint_writer_ignores_adapters(lora_model, base_model):
    from glm52_jax.checkpoint.hf import _hf_tensors

    assert [name for name, _ in _hf_tensors(lora_model)] == [name for name, _ in _hf_tensors(base_model)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0, alpha=1.0), "rank"),
    (dict(rank=2.0, alpha=1.0), "rank"),
    (dict(rank=4, alpha=0.0), "alpha"),
    (dict(rank=4, alpha=float("nan")), "alpha"),
    (dict(rank=4, alpha=8.0, families=frozenset({"attention", "mlp"})), "unknown"),
    (dict(rank=4, alpha=8.0, families=frozenset()), "empty"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)


def test_config_scale_and_options():
    cfg = LoRAConfig(rank=8, alpha=16, families={"unembed"})
    assert cfg.scale == 2.0 and cfg.families == frozenset({"unembed"})
    assert LoRAConfig(rank=8, alpha=16, families="attention").families == frozenset({"attention"})
    with pytest.raises(ValueError, match="LoRAConfig"):
        glm52_jax.ModelOptions(lora={"rank": 4})
