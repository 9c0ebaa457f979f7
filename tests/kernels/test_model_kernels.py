"""A tiny GLM-5.2 with kernels="pallas" (interpret mode on CPU) equals the reference path (float32, 1e-5).

One shape: a prompt longer than index_topk (so the selection is sparse and early queries have -1 slots),
the forward's logits, and the LoRA gradients of the conventional and response_only modes (the latter
attends through the decode cache: the kernels read it in place as a second row table).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lora_utils import fast_rngs, with_random_b

import glm52_jax
from glm52_jax import config
from glm52_jax.model.lora import LoRAConfig
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.rl.gradients import lora_gradients

REFERENCE = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                                   attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0), kernels="reference")
PALLAS = dataclasses.replace(REFERENCE, kernels="pallas")
# Dense+full, MoE+shared: both indexer kinds and the IndexShare hand-over in two layers.
CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
P, G, R = 40, 2, 5
RTOL = 1e-5


@pytest.fixture(scope="module")
def models():
    reference = with_random_b(GlmMoeDsa(CFG, REFERENCE, rngs=fast_rngs()))
    pallas = GlmMoeDsa(CFG, PALLAS, rngs=fast_rngs())
    nnx.update(pallas, nnx.state(reference))  # the very same weights and adapters
    return reference, pallas


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return dict(prompt=rng.integers(0, 512, P).astype(np.int32),
                responses=rng.integers(0, 512, (G, R)).astype(np.int32),
                response_mask=np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float32),
                old_logprobs=np.full((G, R), -6.0, np.float32), advantages=np.array([1.0, -0.5], np.float32))


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def test_forward_logits(models):
    reference, pallas = models
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 512, (1, P)), jnp.int32)
    ref = reference(ids)
    assert _rel(pallas(ids), ref) <= RTOL


# ~35 s each, `slow` for CI's budget (the kernels' own backward is checked in tests/kernels/test_sparse_mla_kernel.py).
@pytest.mark.parametrize("mode", [pytest.param("conventional", marks=pytest.mark.slow),
                                  pytest.param("response_only", marks=pytest.mark.slow)])
def test_lora_gradients(models, batch, mode):
    reference, pallas = models
    ref = lora_gradients(reference, **batch, mode=mode)
    ours = lora_gradients(pallas, **batch, mode=mode)
    assert _rel(ours.logprobs, ref.logprobs) <= RTOL
    flat_ref = dict(nnx.to_flat_state(ref.grads))
    for path, grad in nnx.to_flat_state(ours.grads):
        expected = flat_ref[path].get_value()
        assert np.max(np.abs(expected)) > 0, path  # every adapter really gets a gradient
        assert _rel(grad.get_value(), expected) <= RTOL, (path, _rel(grad.get_value(), expected))
