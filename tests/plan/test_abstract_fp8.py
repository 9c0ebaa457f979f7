"""Plan mode's abstract model with FP8 base weights (`plan.abstract.abstract_model(..., fp8)`).

What the plan compiles must be what a run holds: the same parameters FP8, with the same value and scale shapes,
blocks, dtypes and shardings as a loaded FP8 checkpoint and as a random init quantized as `base_weights="fp8"`
quantizes one (`hf.quantize_model`, in `rl.policy.build_base`), on folded=8 (virtual CPU devices, FSDP). At
GLM-5.2's size the FP8 base is about half the BF16 one.
"""

from __future__ import annotations

import fp8_checkpoint as fc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm52_jax
from glm52_jax import config
from glm52_jax.checkpoint import hf_fp8
from glm52_jax.checkpoint.hf import quantize_model
from glm52_jax.model import fp8
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import axis_rules
from glm52_jax.plan.abstract import abstract_model, tree_bytes

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32)


def _numpy_init(cfg) -> GlmMoeDsa:
    """A random init drawn by numpy (an eager init compiles every op of every shape: ~20 s here)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, OPTS, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    return nnx.merge(graphdef, nnx.from_flat_state([
        (k, v.replace(jnp.asarray(0.02 * rng.standard_normal(v.get_value().shape), v.get_value().dtype)))
        for k, v in nnx.to_flat_state(state)]))


def _values(state) -> dict[tuple, object]:
    return {k: v.get_value() for k, v in nnx.to_flat_state(state)}


def _described(value):
    """(kind, block, dtype, [(shape, dtype, sharding) per array]) of a parameter value, real or abstract."""
    block = (value.block, value.dtype) if isinstance(value, fp8.Fp8Weight) else None
    return block, [(tuple(x.shape), x.dtype, x.sharding) for x in jax.tree.leaves(value)]


@pytest.mark.parametrize("source", ["checkpoint", "random"])
def test_fp8_abstract_model_is_what_a_run_holds(tmp_path, source):
    spec = parse_mesh("folded=8")
    mesh = spec.make()
    cfg = config.tiny()
    with axis_rules(spec.rules()):
        if source == "checkpoint":  # the FP8 release's format (128 x 128, weights_proj left out), written apart
            path = fc.write(tmp_path / "fp8", cfg, fc.fp8_tensors(fc.random_tensors(cfg), (128, 128)),
                            fc.quant_config((128, 128)))
            model = glm52_jax.load_pretrained(path, dtype=jnp.float32, shardings=mesh, options=OPTS)
        else:  # a random init of the tiny preset quantized as build_base does it, placed as build_policy places it
            model = place_model(quantize_model(_numpy_init(cfg), hf_fp8.RELEASE), mesh)
        held = _values(nnx.state(model))
        _, state = abstract_model(model.cfg, OPTS, mesh, hf_fp8.RELEASE)
    planned = _values(state)
    assert held.keys() == planned.keys()
    quantized = {k for k, v in planned.items() if isinstance(v, fp8.Fp8Weight)}
    assert {k[-1] for k in quantized} == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "w_uk", "w_uv", "o_proj",
                                          "wq_b", "wk", "gate_proj", "up_proj", "down_proj", "w_gate", "w_up", "w_down"}
    for key in held:
        assert _described(held[key]) == _described(planned[key]), key


def test_fp8_halves_the_glm52_base():
    """GLM-5.2 on folded=8 (abstract, nothing allocated): ~744B parameters in e4m3 + float32 scales per 128 x 128
    block (1/4096 of the e4m3 bytes) against bf16, globally and per device."""
    spec = parse_mesh("folded=8")
    mesh = spec.make()
    cfg = config.glm52()
    opts = glm52_jax.ModelOptions(param_dtype=jnp.bfloat16)
    with axis_rules(spec.rules()):
        bf16 = abstract_model(cfg, opts, mesh)[1]
        fp8_state = abstract_model(cfg, opts, mesh, hf_fp8.RELEASE)[1]
    for per_device in (False, True):
        ratio = tree_bytes(fp8_state, per_device) / tree_bytes(bf16, per_device)
        assert 0.5 < ratio < 0.52, (per_device, ratio)
    assert 90e9 < tree_bytes(fp8_state, True) < 95e9  # ~93 GB of the H200's 141 per device
