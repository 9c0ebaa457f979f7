"""The MoE block under a mesh that shards the experts: every token count runs expert-parallel.

A decode step has a few tokens (here 3, on 8 devices); they are padded to one per device and routed
to the experts' owners. Checked: the output and the LoRA / input gradients equal the one-device MoE
(float32), and the compiled program moves tokens (all-to-all), never an expert stack (no all-gather
of a [E, ...] routed-expert kernel).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax import config
from glm52_jax.model.expert_parallel import pad_tokens, token_shards
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.moe import MoE
from glm52_jax.model.options import ModelOptions
from glm52_jax.parallel import rules
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

CFG = config.tiny()
LORA = LoRAConfig(rank=4, alpha=8.0, families=frozenset({"routed_experts", "shared_expert"}))


@pytest.fixture(scope="module")
def moe():
    module = MoE(CFG, ModelOptions(param_dtype=jnp.float32, lora=LORA), nnx.Rngs(0, lora=1))
    rng = np.random.default_rng(3)
    shared = module.shared_experts
    for ad in (module.w_gate_lora, module.w_up_lora, module.w_down_lora, shared.gate_proj_lora, shared.up_proj_lora,
               shared.down_proj_lora):  # B nonzero: every A gets a gradient
        ad.b[...] = jnp.asarray(0.3 * rng.standard_normal(ad.b[...].shape), jnp.float32)
    return module


def _value_and_grads(module, x, cot):
    """(loss, MoE output), (LoRA gradients, input gradient) of <MoE(x), cot>."""
    graphdef, lora, rest = nnx.split(module, LoRA, ...)

    def loss(lora, x):
        out = nnx.merge(graphdef, lora, rest)(x)
        return jnp.sum(out * cot), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lora, x)


def test_pad_tokens_spreads_zero_weight_tokens():
    x, w, e = jnp.ones((3, 4)), jnp.ones((3, 2)), jnp.zeros((3, 2), jnp.int32)
    px, pw, pe = pad_tokens(x, w, e, shards=8, num_experts=8)
    assert px.shape == (8, 4) and pw.shape == (8, 2) and pe.shape == (8, 2)
    assert float(jnp.abs(px[3:]).max()) == 0 and float(jnp.abs(pw[3:]).max()) == 0
    assert sorted(np.asarray(pe[3:]).ravel().tolist()) == sorted([i % 8 for i in range(10)])
    assert pad_tokens(px, pw, pe, shards=8, num_experts=8)[0] is px  # already a multiple: unchanged


@pytest.mark.parametrize("mesh_text", ["folded=8", pytest.param("context=4,expert=2", marks=pytest.mark.slow)])
def test_few_tokens_run_expert_parallel(moe, mesh_text):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((1, 3, CFG.hidden_size)), jnp.float32)  # [B, S, D]: a 3-token step
    cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    (_, ref), ref_grads = _value_and_grads(moe, x, cot)

    spec = parse_mesh(mesh_text)
    mesh = spec.make()
    with rules.axis_rules(spec.rules()):
        placed = place_model(moe, mesh)
        with jax.set_mesh(mesh):
            assert token_shards(CFG.n_routed_experts) == 8
            (_, out), grads = _value_and_grads(placed, x, cot)
            graphdef, lora, rest = nnx.split(placed, LoRA, ...)
            hlo = jax.jit(lambda lora, x: nnx.merge(graphdef, lora, rest)(x)).lower(lora, x).compile().as_text()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert float(jnp.max(jnp.abs(r))) > 0
        # Gradients summed over tokens of several devices: float reassociation (as tests/model/test_expert_parallel.py).
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    # Tokens travel (all-to-all), the experts' kernels [E, D, I] / [E, I, D] are never gathered.
    e, d, i = CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size
    gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
    assert "all-to-all" in hlo
    assert not any(f"[{e},{d},{i}]" in g or f"[{e},{i},{d}]" in g for g in gathers), gathers


def _moe_on_folded8(seed: int, **options) -> tuple[str, np.ndarray]:
    """(jaxpr text, output) of a float32 dense-transport MoE with `options` on a folded 8-device mesh, on
    random x [1, 256, D] (32 tokens per device)."""
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((1, 256, CFG.hidden_size)), jnp.float32)
    spec = parse_mesh("folded=8")
    mesh = spec.make()
    module = MoE(CFG, ModelOptions(param_dtype=jnp.float32, moe_transport="dense", **options), nnx.Rngs(0))
    with rules.axis_rules(spec.rules()):
        placed = place_model(module, mesh)
        with jax.set_mesh(mesh):
            graphdef, state = nnx.split(placed)
            fn = lambda state, x: nnx.merge(graphdef, state)(x)  # noqa: E731
            return str(jax.make_jaxpr(fn)(state, x)).replace("\n", " "), np.asarray(jax.jit(fn)(state, x))


def test_exchange_windows_option_reaches_the_exchange():
    """`ModelOptions.moe_exchange_windows` (config `model.moe_exchange_windows`) sets how many windows each pass's
    exchange is split into: 1 is one all-to-all out and one back per pass; 2 (the default) twice that. Same output."""
    (one, out_1), (two, out_2) = (_moe_on_folded8(7, moe_exchange_windows=w) for w in (1, 2))
    assert (one.count("all_to_all["), two.count("all_to_all[")) == (2, 4)
    np.testing.assert_allclose(out_2, out_1, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="moe_exchange_windows: expected a positive integer"):
        ModelOptions(moe_exchange_windows=0)


def test_node_devices_option_reaches_the_exchange():
    """`ModelOptions.moe_node_devices` (config `model.moe_node_devices`): 4 on 8 devices runs the two-stage exchange
    (all-to-alls among {0,4}, {1,5}, ... and within {0..3}, {4..7}, none over all 8); same output as one stage."""
    (flat, out_flat), (nodes, out_nodes) = (_moe_on_folded8(8, moe_node_devices=n) for n in (0, 4))
    groups = [set(re.findall(r"all_to_all\[[^\]]*?axis_index_groups=(None|\(\(.*?\)\))", j)) for j in (flat, nodes)]
    assert groups[0] == {"None"}, groups[0]
    assert groups[1] == {"((0, 4), (1, 5), (2, 6), (3, 7))", "((0, 1, 2, 3), (4, 5, 6, 7))"}, groups[1]
    np.testing.assert_allclose(out_nodes, out_flat, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="moe_node_devices: expected an integer >= 0"):
        ModelOptions(moe_node_devices=-1)


def test_fp8_experts_run_expert_parallel_as_on_one_device():
    """`ModelOptions.expert_dtype="fp8"` (w8a8: rows and expert kernels in e4m3, `grouped_mlp.ragged_w8a8` here):
    the expert-parallel MoE on 8 devices, in one stage and in two, equals the one-device MoE with the same option
    (float32). Its distance from the unquantized MoE is e4m3's rounding (3 mantissa bits: a few % of the routed
    output), and the rows are quantized in the program (e4m3 converts in the jaxpr)."""
    x = jnp.asarray(np.random.default_rng(9).standard_normal((1, 256, CFG.hidden_size)), jnp.float32)
    one = {}
    for dtype in ("bf16", "fp8"):
        module = MoE(CFG, ModelOptions(param_dtype=jnp.float32, expert_dtype=dtype), nnx.Rngs(0))
        one[dtype] = np.asarray(jax.jit(lambda m, x: m(x))(module, x))
    for nodes in (0, 4):
        text, out = _moe_on_folded8(9, expert_dtype="fp8", moe_node_devices=nodes)
        assert "f8_e4m3fn" in text
        # Two stages: the rows travel as FP8 rows' bytes (values, scales and, within a node, the expert id).
        assert bool(re.search(r"u8\[[\d,]+\] = all_to_all", text)) == (nodes > 0)
        np.testing.assert_allclose(out, one["fp8"], rtol=2e-5, atol=2e-5)
    error = np.linalg.norm(one["fp8"] - one["bf16"]) / np.linalg.norm(one["bf16"])
    assert 1e-3 < error < 0.08, error
    with pytest.raises(ValueError, match="expert_dtype: expected one of"):
        ModelOptions(expert_dtype="fp16")


def test_fp8_rows_in_transit_differentiate_as_the_float_rows():
    """FP8 experts on the two-stage exchange (2 nodes of 4), rows sent as FP8 bytes: the output, the routed and shared
    LoRA gradients and the input gradient equal the one-device FP8 MoE's (float32; gradients straight through the
    rows' quantization, the VJP of the float rows' exchange)."""
    opts = ModelOptions(param_dtype=jnp.float32, lora=LORA, expert_dtype="fp8", moe_transport="dense",
                        moe_node_devices=4)
    module = MoE(CFG, opts, nnx.Rngs(0, lora=1))
    rng = np.random.default_rng(6)
    shared = module.shared_experts
    for ad in (module.w_gate_lora, module.w_up_lora, module.w_down_lora, shared.gate_proj_lora, shared.up_proj_lora,
               shared.down_proj_lora):  # B nonzero: every A gets a gradient
        ad.b[...] = jnp.asarray(0.3 * rng.standard_normal(ad.b[...].shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 64, CFG.hidden_size)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    (_, ref), ref_grads = _value_and_grads(module, x, cot)
    spec = parse_mesh("folded=8")
    mesh = spec.make()
    with rules.axis_rules(spec.rules()):
        placed = place_model(module, mesh)
        with jax.set_mesh(mesh):
            (_, out), grads = _value_and_grads(placed, x, cot)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert float(jnp.max(jnp.abs(r))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)
