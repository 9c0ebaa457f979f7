"""FP8 weights (`model.fp8`): the dequantization, and its use where the weight lives on a mesh.

Beside numpy: each scale covers its block (partial blocks included, leading dims unblocked) and no gradient
reaches the frozen weight. On 8 virtual devices (folded=8, FSDP): a projection whose FP8 kernel a few-token
call keeps sharded computes on the local shards with the same collectives as the dense kernel (nothing more
moves), a gathered one all-gathers the e4m3 bytes; the expert-parallel MoE (bounded receive buffer: the
custom-VJP pass loop) with FP8 expert stacks equals the one-device experts on the dequantized weights,
outputs and LoRA gradients. Whole-model parity: tests/checkpoint/test_hf_fp8.py.
"""

from __future__ import annotations

import functools
import re

import fp8_checkpoint as fc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax.model import fp8
from glm52_jax.model.expert_parallel import experts_ep
from glm52_jax.model.grouped_mlp import experts_ragged
from glm52_jax.model.layers import gathered, project
from glm52_jax.parallel import tensor_parallel
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import axis_rules


def quantized(w: np.ndarray, block: tuple[int, int], dtype=jnp.float32) -> fp8.Fp8Weight:
    """`w [*lead, m, n]` as an Fp8Weight with `block` on its last two dims (the test helper's block rule)."""
    lead = w.shape[:-2]
    parts = [fc.quantize(m, block) for m in w.reshape(-1, *w.shape[-2:])]
    values = np.stack([v for v, _ in parts]).reshape(w.shape)
    scales = np.stack([s for _, s in parts]).reshape(*lead, *parts[0][1].shape)
    return fp8.Fp8Weight(jnp.asarray(values), jnp.asarray(scales), block, jnp.dtype(dtype))


def test_dense_expands_each_scale_over_its_block_and_stops_gradients():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 5, 7)).astype(fp8.E4M3)  # lead 2; 5 x 7 in blocks of 2 x 3: partial ones
    scales = rng.uniform(0.5, 2.0, (2, 3, 3)).astype(np.float32)
    w = fp8.Fp8Weight(jnp.asarray(values), jnp.asarray(scales), (2, 3), jnp.dtype(jnp.float32))
    want = np.empty((2, 5, 7), np.float32)
    for lead, i, j in np.ndindex(2, 5, 7):
        want[lead, i, j] = np.float32(values[lead, i, j]) * scales[lead, i // 2, j // 3]
    np.testing.assert_array_equal(np.asarray(jax.jit(fp8.dense)(w)), want)
    bf16 = fp8.dense(fp8.Fp8Weight(w.values, w.scales, w.block, jnp.dtype(jnp.bfloat16)))
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), want.astype(jnp.bfloat16))  # one rounding of the product
    grads = jax.grad(lambda w: jnp.sum(fp8.dense(w)))(w)  # the frozen base: zero cotangents, e4m3 and float32
    assert not np.any(np.asarray(grads.values, np.float32)) and not np.any(np.asarray(grads.scales))
    assert fp8.dense(want) is want  # anything else passes through


# ------------------------------------------------------------------------------------------------
# On a mesh.


class Kernel(nnx.Module):
    """One projection kernel [D, Q] with the logical axes of `q_a_proj`."""

    def __init__(self, value):
        self.kernel = nnx.Param(value, out_sharding=("embed", "q_lora"), eager_sharding=False)


D, Q, TOKENS = 64, 48, 3
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


@pytest.fixture(scope="module")
def mesh_kernels():
    """folded=8 with FSDP: the FP8 kernel (blocks 16 x 12) and its dequantized float32 twin, placed."""
    w = quantized(np.random.default_rng(1).standard_normal((D, Q)).astype(np.float32) * 0.1, (16, 12))
    spec = parse_mesh("folded=8")
    mesh = spec.make()
    with axis_rules(spec.rules()):
        placed = {name: place_model(Kernel(value), mesh) for name, value in (("fp8", w), ("dense", fp8.dense(w)))}
    return spec, mesh, placed


def _program(spec, mesh, module, keep: bool):
    """(result, compiled HLO) of `project` of a few tokens: the kernel kept in place (`keep`) or gathered."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((TOKENS, D)), jnp.float32)
    graphdef, state = nnx.split(module)

    def run(state, x):
        with tensor_parallel.active(keep):
            m = nnx.merge(graphdef, state)
            return project(x, (m if keep else gathered(m)).kernel, "td,dq->tq")

    with axis_rules(spec.rules()), jax.set_mesh(mesh):
        fn = jax.jit(run)
        return np.asarray(fn(state, x)), fn.lower(state, x).compile().as_text()


def test_fp8_scales_are_placed_whole_beside_fsdp_sharded_values(mesh_kernels):
    _, _, placed = mesh_kernels
    w, dense = placed["fp8"].kernel.get_value(), placed["dense"].kernel.get_value()
    assert w.values.sharding.spec == dense.sharding.spec == jax.sharding.PartitionSpec("cp_ep", None)
    assert w.values.addressable_shards[0].data.shape == (D // 8, Q)
    assert w.scales.sharding.is_fully_replicated and w.scales.shape == (4, 4)


@pytest.mark.parametrize("keep", [True, False])
def test_fp8_projection_on_a_mesh_moves_what_the_dense_one_moves(mesh_kernels, keep):
    spec, mesh, placed = mesh_kernels
    got, hlo = _program(spec, mesh, placed["fp8"], keep)
    want, dense_hlo = _program(spec, mesh, placed["dense"], keep)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert sorted(m.group(1) for m in COLLECTIVE.finditer(hlo)) == sorted(
        m.group(1) for m in COLLECTIVE.finditer(dense_hlo)), (keep, hlo)
    # Gathered: the e4m3 values travel (XLA:CPU widens them to f16 for its all-gather: still not the dense f32);
    # kept: the weight never does.
    moved, dense_moved = (re.findall(rf"(\w+)\[{D},{Q}\]\S* all-gather", text) for text in (hlo, dense_hlo))
    assert dense_moved == ([] if keep else ["f32"])
    assert moved == [] if keep else moved in (["f8e4m3fn"], ["f16"]), moved


# ------------------------------------------------------------------------------------------------
# The expert-parallel MoE with FP8 expert stacks.

E, ED, EI, T, K = 16, 32, 16, 64, 4


@functools.partial(jax.jit, static_argnums=0)
def _experts(fn, x, weights, experts, w):
    """(output, d<output, 1>/dx): the routed experts' value and the gradient that reaches the rows."""
    out, vjp = jax.vjp(lambda x: fn(x, weights, experts, *w), x)
    return out, vjp(jnp.ones_like(out))[0]


def test_fp8_expert_parallel_matches_one_device_dequantized():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((T, ED)), jnp.float32)
    w = (quantized(rng.standard_normal((E, ED, EI)).astype(np.float32) / np.sqrt(ED), (8, 12)),
         quantized(rng.standard_normal((E, ED, EI)).astype(np.float32) / np.sqrt(ED), (8, 12)),
         quantized(rng.standard_normal((E, EI, ED)).astype(np.float32) / np.sqrt(EI), (12, 8)))
    logits = rng.standard_normal((T, E))
    logits[:, 4:4 + K] += 100.0  # every pair to one device: a bounded receive buffer needs several passes
    experts = jnp.asarray(np.argsort(-logits, axis=-1)[:, :K], jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    want = _experts(experts_ragged, x, weights, experts, tuple(fp8.dense(a) for a in w))
    spec = parse_mesh("folded=8")
    mesh = spec.make()
    expert_sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cp_ep"))
    with axis_rules(spec.rules()), jax.set_mesh(mesh):
        w_placed = jax.device_put(w, expert_sharded)  # values and scales: E/8 experts per device
        ep = functools.partial(experts_ep, receive_capacity=1.0)
        got = _experts(ep, x, weights, experts, w_placed)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)



# ------------------------------------------------------------------------------------------------
# Quantizing (a random init under model.base_weights="fp8").


@pytest.mark.parametrize("shape, block", [((2, 50, 37), (16, 12)), ((300, 200), (128, 128)), ((3, 5, 7), (1, 4, 8))])
def test_quantize_follows_the_release_rule(shape, block):
    """`fp8.quantize` against the test helper's independent numpy rule, per block of the trailing dims: scale =
    amax / 448 (XLA:CPU divides through a reciprocal: within 1 ulp of numpy's), value = w / scale rounded to e4m3
    (the helper's, or one e4m3 step from it where that ulp tips a tie); an all-zero block gets scale 1."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal(shape) * 0.08).astype(np.float32)
    w[..., :block[-2], :block[-1]] = 0
    got = jax.jit(fp8.quantize, static_argnums=1)(jnp.asarray(w), block)
    assert got.values.dtype == fp8.E4M3 and got.scales.dtype == jnp.float32 and got.block == block
    assert got.scales.shape == fp8.scale_shape(shape, block) and got.dtype == jnp.float32
    scales, values = np.asarray(got.scales), np.asarray(got.values).astype(np.float32)
    assert np.all(scales[..., 0, 0] == 1.0) and not np.any(values[..., :block[-2], :block[-1]])
    # Per matrix of the leading dims (a leading block of 1 is the same thing).
    lead = shape[:-2]
    for index in np.ndindex(lead):
        want_values, want_scales = fc.quantize(w[index], block[-2:])
        want_values = want_values.astype(np.float32)
        np.testing.assert_allclose(scales[index], want_scales, rtol=2.0 ** -23, atol=0)
        step = np.maximum(np.maximum(np.abs(values[index]), np.abs(want_values)) / 8, 2.0 ** -9)
        assert np.all(np.abs(values[index] - want_values) <= step) and np.mean(values[index] != want_values) < 0.01
    # e4m3 keeps 3 mantissa bits: |w - value x scale| <= 2^-4 |w| (normals), 2^-10 x scale (subnormals).
    full = np.asarray(fp8.expand_scales(got.scales, block, shape))
    error = np.abs(np.asarray(fp8.dense(got)) - w)
    assert np.all(error <= np.maximum(np.abs(w) * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6))
