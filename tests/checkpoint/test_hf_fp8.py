"""FP8 checkpoints: loading (every dequantized number), malformed inputs, and the FP8 model's parity.

Tiny FP8 checkpoints are written by `tests/fp8_checkpoint.py` (numpy + the reference `safetensors`): random
float32 weights quantized with the DeepSeek-V3 block rule. Block sizes are small and uneven so that the tiny
matrices have several blocks, partial last blocks, and every way our layouts cut HF's blocks: (16, 12) puts
q_b's 40-row heads, kv_b and o_proj's heads across block edges (per-element scales) and wq_b's 32-row heads
on whole blocks; (80, 32) fits two of q_b's heads in a block and o_proj's 32-column heads on whole blocks.

The reference for every FP8 number is the same checkpoint dequantized in HF's layout by the test helper
(one float32 product per element) and loaded by the plain loader (whose layouts tests/checkpoint/test_hf.py
checks against HF). The dequantized parameters must then be equal bit for bit: IEEE float32 products round
the same on both sides.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import fp8_checkpoint as fc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from lora_utils import random_adapters

import glm52_jax
from glm52_jax import config
from glm52_jax.checkpoint import hf, hf_fp8
from glm52_jax.model import fp8
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.rules import axis_rules
from glm52_jax.rollout.sampler import Sampler, SamplingParams

# Two MoE layers of one kind: one scanned stack (stacked experts [2, 8, D, I]); the dense MLP's projections
# are the shared expert's code path.
CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "full"), first_k_dense_replace=0, vocab_size=128)
BLOCK = (16, 12)
OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8, remat=False, lora=LoRAConfig(rank=4, alpha=8.0))
# FP8 model vs the same numbers in float32: the weights it multiplies are equal bit for bit (asserted below),
# so logits can differ only where XLA associates float32 sums differently in the two programs. A dot over
# K <= 128 terms then moves by ~sqrt(K) x 6e-8 relative, ~1e-6 after a few layers: bound 1e-5 of the largest
# |logit| (fixed before the first run).
LOGIT_RTOL = 1e-5
GRAD_COSINE = 0.999  # issue 22
PROMPT_LEN, NEW_TOKENS = 29, 16  # prompt + new tokens > index_topk (32): the indexer really selects


def fp8_dirs(root, block):
    """(FP8 checkpoint, its dequantized float32 twin, the unquantized original) under `root`."""
    tensors = fc.random_tensors(CFG, seed=1)
    quantized = fc.fp8_tensors(tensors, block)
    return (fc.write(root / "fp8", CFG, quantized, fc.quant_config(block)),
            fc.write(root / "dequantized", CFG, fc.dequantized_tensors(quantized, block)),
            fc.write(root / "original", CFG, tensors))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return fp8_dirs(tmp_path_factory.mktemp("fp8"), BLOCK)


_dense_all = jax.jit(lambda params: jax.tree.map(fp8.dense, params, is_leaf=lambda x: isinstance(x, fp8.Fp8Weight)))


def flat_values(model) -> dict[tuple, object]:
    return {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ------------------------------------------------------------------------------------------------
# Loading.


@pytest.mark.parametrize("block", [BLOCK, (80, 32)])
def test_fp8_load_keeps_e4m3_and_dequantizes_to_the_checkpoints_numbers(tmp_path, block):
    fp8_dir, ref_dir, _ = fp8_dirs(tmp_path, block)
    model = glm52_jax.load_pretrained(fp8_dir, dtype=jnp.float32)
    ref = flat_values(glm52_jax.load_pretrained(ref_dir, dtype=jnp.float32))
    values = flat_values(model)
    assert values.keys() == ref.keys()
    held = {k for k, v in values.items() if isinstance(v, fp8.Fp8Weight)}
    # Every projection matrix is FP8; weights_proj (modules_to_not_convert), norms, router, embeddings are not.
    assert {k[-1] for k in held} == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "w_uk", "w_uv", "o_proj", "wq_b",
                                     "wk", "gate_proj", "up_proj", "down_proj", "w_gate", "w_up", "w_down"}
    assert not any(k[-1] in ("weights_proj", "router", "embed_tokens", "lm_head", "weight") for k in held)
    for key in held:
        w = values[key]
        assert w.values.dtype == jnp.float8_e4m3fn and w.scales.dtype == jnp.float32 and w.dtype == jnp.float32
        assert w.shape == ref[key].shape and w.scales.shape == fp8.scale_shape(w.shape, w.block), key
    dense = _dense_all(values)
    for key in values:
        np.testing.assert_array_equal(np.asarray(dense[key]), np.asarray(ref[key]), err_msg=str(key))
    stack = ("stacks", 0, "layers", 0, "self_attn")
    if block == BLOCK:  # heads across block edges: one scale per element of the head dims
        assert values[stack + ("q_b_proj",)].block == (12, 1, 1) and values[stack + ("w_uv",)].block == (12, 1, 1)
        assert values[stack + ("o_proj",)].block == (1, 1, 16)
        assert values[stack + ("indexer", "wq_b")].block == (12, 1, 16)
        assert values[("stacks", 0, "layers", 0, "mlp", "w_gate")].scales.shape == (2, 8, 6, 2)  # [L, E, D/12, I/16]
    else:
        assert values[stack + ("q_b_proj",)].block == (32, 2, 40)  # two 40-row heads per 80-row block
        assert values[stack + ("o_proj",)].block == (1, 32, 80)


def test_fp8_load_on_a_mesh_reads_each_devices_slices(dirs):
    """folded=8 with FSDP: values sharded as the dense weight would be, scales by the unblocked logical axes
    (the experts) and whole elsewhere; every number as in the one-device load."""
    spec = parse_mesh("folded=8")
    with axis_rules(spec.rules()):
        sharded = flat_values(glm52_jax.load_pretrained(dirs[0], dtype=jnp.float32, shardings=spec.make()))
        dense = flat_values(glm52_jax.load_pretrained(dirs[1], dtype=jnp.float32, shardings=spec.make()))
    plain = flat_values(glm52_jax.load_pretrained(dirs[0], dtype=jnp.float32))
    q_a, w_up = ("stacks", 0, "layers", 0, "self_attn", "q_a_proj"), ("stacks", 0, "layers", 0, "mlp", "w_up")
    assert sharded[q_a].values.sharding.spec == dense[q_a].sharding.spec == P(None, "cp_ep", None)  # FSDP on D
    assert sharded[q_a].scales.sharding.is_fully_replicated
    assert sharded[w_up].values.sharding.spec == dense[w_up].sharding.spec == P(None, "cp_ep", None, None)
    assert sharded[w_up].scales.sharding.spec == P(None, "cp_ep", None, None)  # one expert's scales per device
    for key, value in plain.items():
        for got, want in zip(jax.tree.leaves(sharded[key]), jax.tree.leaves(value), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(key))


def test_quantization_config_is_not_part_of_the_model_config(dirs):
    model = glm52_jax.load_pretrained(dirs[0], dtype=jnp.float32)
    assert "quantization_config" in json.loads(open(os.path.join(dirs[0], "config.json")).read())
    assert "quantization_config" not in dict(model.cfg.extra)
    saved = os.path.join(os.path.dirname(dirs[0]), "saved")  # dequantized (test_hf_fp8_save.py): no FP8 config
    glm52_jax.save_pretrained(model, saved)
    assert "quantization_config" not in json.loads(open(os.path.join(saved, "config.json")).read())


def _broken(tensors, quant, case):
    """The FP8 checkpoint's tensors and quantization_config, broken in one way."""
    tensors, quant = dict(tensors), dict(quant)
    layer1 = "model.layers.1."
    if case == "missing_scale":
        del tensors[layer1 + "self_attn.o_proj.weight_scale_inv"]
    elif case == "grid":  # quantized with 8 x 8 blocks, config says 16 x 12
        name = layer1 + "self_attn.q_a_proj.weight"
        tensors[name], tensors[name + "_scale_inv"] = fc.quantize(tensors[name].astype(np.float32), (8, 8))
    elif case == "no_config":
        quant = None
    elif case == "e5m2":
        quant["fmt"] = "e5m2"
    elif case == "block_size":
        quant["weight_block_size"] = [128]
    elif case == "router":
        name = layer1 + "mlp.gate.weight"
        tensors[name], tensors[name + "_scale_inv"] = fc.quantize(tensors[name], BLOCK)
    elif case == "not_convert":
        quant["modules_to_not_convert"] = ["layers.1.self_attn.o_proj"]
    elif case == "mixed_stack":  # layer 1 plain, layer 0 FP8: both are one stacked parameter
        name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
        tensors[name] = fc.dequantize(tensors[name], tensors.pop(name + "_scale_inv"), BLOCK)
    elif case == "orphan_scale":
        tensors["model.layers.1.mlp.experts.9.up_proj.weight_scale_inv"] = np.ones((2, 6), np.float32)
    return tensors, quant


@pytest.mark.parametrize("case, message", [
    ("missing_scale", r"'model.layers.1.self_attn.o_proj.weight' is F8_E4M3 but has no "
                      r"'model.layers.1.self_attn.o_proj.weight_scale_inv'"),
    ("grid", r"'model.layers.1.self_attn.q_a_proj.weight_scale_inv' has shape \(6, 8\), but "
             r"'model.layers.1.self_attn.q_a_proj.weight' \(48, 64\) in weight_block_size \[16, 12\] blocks needs "
             r"\(3, 6\)"),
    ("no_config", r"'model.layers.0.mlp.experts.0.down_proj.weight_scale_inv' is an FP8 block scale, but "
                  r"config.json has no quantization_config"),
    ("e5m2", r"quantization_config.fmt: only 'e4m3' is supported, got 'e5m2'"),
    ("block_size", r"weight_block_size: expected two positive integers \(e.g. \[128, 128\]\), got \[128\]"),
    ("router", r"'model.layers.1.mlp.gate.weight' is FP8, but this module is kept in its stored dtype"),
    ("not_convert", r"'model.layers.1.self_attn.o_proj.weight_scale_inv': module 'model.layers.1.self_attn.o_proj' "
                    r"is listed in quantization_config.modules_to_not_convert"),
    ("mixed_stack", r"'model.layers.1.self_attn.kv_a_proj_with_mqa.weight' is not FP8 but "
                    r"'model.layers.0.self_attn.kv_a_proj_with_mqa.weight' is"),
    ("orphan_scale", r"'model.layers.1.mlp.experts.9.up_proj.weight_scale_inv' scales no weight of this model"),
])
def test_malformed_fp8_checkpoints_fail_naming_the_tensor(tmp_path, case, message):
    tensors = fc.fp8_tensors(fc.random_tensors(CFG, seed=1), BLOCK)
    tensors, quant = _broken(tensors, fc.quant_config(BLOCK), case)
    path = fc.write(tmp_path / case, CFG, tensors, quant)
    with pytest.raises(ValueError, match=message) as err:
        glm52_jax.load_pretrained(path, dtype=jnp.float32)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# A float checkpoint read as its FP8 release (`load_pretrained(fp8=...)`, model.base_weights="fp8").


def _assert_same(got, want, key):
    """Same kind of value, shapes, dtypes, shardings and bits (e4m3 compared as bytes)."""
    assert type(got) is type(want), key
    if isinstance(want, fp8.Fp8Weight):
        assert (got.block, got.dtype) == (want.block, want.dtype), key
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (g.shape, g.dtype, g.sharding) == (w.shape, w.dtype, w.sharding), key
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8), err_msg=str(key))


def test_the_release_rule_is_the_test_helpers():
    """The package's rule (written apart from tests/fp8_checkpoint.py) quantizes the helper's modules, and its
    numpy quantizer gives the helper's values and scales bit for bit, partial and all-zero blocks included."""
    names = hf.expected_tensors(CFG)
    assert hf_fp8.RELEASE == hf_fp8.Fp8Config((128, 128), tuple(fc.NOT_CONVERT))
    assert {n for n in names if hf_fp8.quantizes(n, hf_fp8.RELEASE)} == {n for n in names if fc.is_quantized(n)}
    w = fc.random_tensors(CFG, seed=2)["model.layers.0.self_attn.q_b_proj.weight"]
    w[:16, :12] = 0
    for block in (BLOCK, (80, 32), (128, 128)):
        values, scales = hf_fp8.quantize_hf(w, block)
        want_values, want_scales = fc.quantize(w, block)
        assert values.dtype == want_values.dtype and scales.dtype == np.float32
        np.testing.assert_array_equal(values.view(np.uint8), want_values.view(np.uint8))
        np.testing.assert_array_equal(scales, want_scales)


def test_quantized_view_reads_each_tensor_once(tmp_path):
    """The view's headers say e4m3 + a float32 scale grid; a second read of the same weight (the next device's
    slice) and its scales come from what the first read quantized; other tensors pass through."""
    tensors = fc.random_tensors(CFG, seed=1)
    ckpt = hf._Checkpoint(fc.write(tmp_path / "float", CFG, tensors))
    reads, read = [], ckpt.get
    ckpt.get = lambda name: reads.append(name) or read(name)
    o_proj, q_a = "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.q_a_proj.weight"
    view = hf_fp8.QuantizedView(ckpt, [o_proj, q_a], BLOCK)
    want_values, want_scales = fc.quantize(tensors[o_proj], BLOCK)
    assert view.names() - ckpt.names() == {o_proj + "_scale_inv", q_a + "_scale_inv"}
    assert (view.info(o_proj).dtype, view.info(o_proj).shape) == ("F8_E4M3", tensors[o_proj].shape)
    scale_info = view.info(o_proj + "_scale_inv")
    assert (scale_info.dtype, scale_info.shape) == ("F32", want_scales.shape)
    values = [view.get(o_proj), view.get(o_proj)]
    np.testing.assert_array_equal(view.get(o_proj + "_scale_inv"), want_scales)
    assert reads == [o_proj] and values[0] is values[1]
    np.testing.assert_array_equal(values[0].view(np.uint8), want_values.view(np.uint8))
    # Scales asked before the values: computed from the weight alone (the helper's, bit for bit).
    np.testing.assert_array_equal(view.get(q_a + "_scale_inv"), fc.quantize(tensors[q_a], BLOCK)[1])
    norm = "model.layers.1.input_layernorm.weight"
    assert view.info(norm).dtype == "F32" and np.array_equal(view.get(norm), tensors[norm])


@pytest.mark.parametrize("block, mesh", [(BLOCK, None), ((128, 128), None), (BLOCK, "folded=8")])
def test_quantize_on_load_gives_the_fp8_checkpoints_weights(tmp_path, block, mesh):
    """A float32 checkpoint loaded with `fp8` = (block, the release's modules) holds exactly the parameters,
    Fp8Weights (values and scales) included, that loading the FP8 checkpoint the test helper writes from the
    same tensors gives, on one device and on a mesh (each device reading its slices). An FP8 checkpoint loads as
    stored whatever `fp8` asks."""
    tensors = fc.random_tensors(CFG, seed=1)
    fp8_dir = fc.write(tmp_path / "fp8", CFG, fc.fp8_tensors(tensors, block), fc.quant_config(block))
    float_dir = fc.write(tmp_path / "float", CFG, tensors)
    quant = hf_fp8.Fp8Config(block, hf_fp8.RELEASE.not_convert)
    spec = parse_mesh(mesh or "folded=1")
    with axis_rules(spec.rules()):
        shardings = spec.make() if mesh else None
        got = flat_values(glm52_jax.load_pretrained(float_dir, dtype=jnp.float32, shardings=shardings, fp8=quant))
        want = flat_values(glm52_jax.load_pretrained(fp8_dir, dtype=jnp.float32, shardings=shardings))
        stored = flat_values(glm52_jax.load_pretrained(fp8_dir, dtype=jnp.float32, shardings=shardings,
                                                       fp8=hf_fp8.RELEASE))
    assert got.keys() == want.keys() == stored.keys()
    assert sum(isinstance(v, fp8.Fp8Weight) for v in got.values()) == 14  # one stack: every projection but weights_proj
    for key in want:
        _assert_same(got[key], want[key], key)
        _assert_same(stored[key], want[key], key)


def test_routed_experts_alone_quantized_on_load(tmp_path):
    """`hf_fp8.EXPERTS` (model.expert_dtype="fp8" on a float base): only the routed experts' three stacks are FP8
    (the release's values and scales for them), everything else as stored; the model with FP8 experts then gives the
    logits of the float load quantizing its experts in the program (the same rule, 128 x 128 blocks)."""
    assert hf_fp8.quantizes("model.layers.3.mlp.experts.7.gate_proj.weight", hf_fp8.EXPERTS)
    for other in ("model.layers.3.mlp.shared_experts.gate_proj.weight", "model.layers.3.self_attn.q_a_proj.weight",
                  "model.layers.0.mlp.down_proj.weight"):
        assert not hf_fp8.quantizes(other, hf_fp8.EXPERTS)
    tensors = fc.random_tensors(CFG, seed=2)
    float_dir = fc.write(tmp_path / "float", CFG, tensors)
    opts = dataclasses.replace(OPTS, expert_dtype="fp8")
    got = glm52_jax.load_pretrained(float_dir, dtype=jnp.float32, options=opts, fp8=hf_fp8.EXPERTS)
    release = flat_values(glm52_jax.load_pretrained(float_dir, dtype=jnp.float32,
                                                    fp8=hf_fp8.Fp8Config((128, 128), hf_fp8.RELEASE.not_convert)))
    held = {key: v for key, v in flat_values(got).items() if isinstance(v, fp8.Fp8Weight)}
    assert sorted(key[-1] for key in held) == ["w_down", "w_gate", "w_up"]
    for key, value in held.items():
        _assert_same(value, release[key], key)
    per_call = glm52_jax.load_pretrained(float_dir, dtype=jnp.float32, options=opts)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (1, 24)), jnp.int32)
    want = np.asarray(per_call(ids))
    np.testing.assert_allclose(np.asarray(got(ids)), want, rtol=LOGIT_RTOL, atol=LOGIT_RTOL * np.abs(want).max())


def test_quantize_on_load_needs_per_expert_tensors(tmp_path):
    tensors = fc.random_tensors(CFG, seed=1)
    for layer in range(CFG.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        stacked = {proj: np.stack([tensors.pop(f"{p}{x}.{proj}.weight") for x in range(CFG.n_routed_experts)])
                   for proj in ("gate_proj", "up_proj", "down_proj")}
        tensors[p + "gate_up_proj"] = np.concatenate([stacked["gate_proj"], stacked["up_proj"]], axis=1)
        tensors[p + "down_proj"] = stacked["down_proj"]
    path = fc.write(tmp_path / "fused", CFG, tensors)
    glm52_jax.load_pretrained(path, dtype=jnp.float32)  # as stored: fine
    with pytest.raises(ValueError, match=r"quantizing to FP8 while loading needs per-expert tensors such as "
                                         r"'model.layers.0.mlp.experts.0.down_proj.weight'; this checkpoint stores "
                                         r"the experts fused"):
        glm52_jax.load_pretrained(path, dtype=jnp.float32, fp8=hf_fp8.RELEASE)


# ------------------------------------------------------------------------------------------------
# Parity: the FP8 model against the same numbers in a float32 checkpoint, with the same LoRA adapters.


@pytest.fixture(scope="module")
def models(dirs):
    """{name: model with LoRA (random A and B)}: 'fp8' holds the FP8 base, 'ref' the dequantized one, 'original'
    the unquantized weights; all three share the very same adapter arrays."""
    graphdef, _, shapes = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(CFG, OPTS, rngs=nnx.Rngs(0))), nnx.Param, LoRA)
    lora = random_adapters(shapes, seed=3)
    out = {}
    for name, path in zip(("fp8", "ref", "original"), dirs):
        base = glm52_jax.load_pretrained(path, dtype=jnp.float32, options=dataclasses.replace(OPTS, lora=None))
        out[name] = nnx.merge(graphdef, nnx.state(base, nnx.Param), lora)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(graphdef, params, lora, ids):
    """Mean next-token NLL of `ids: [B,S]`, its LoRA gradients, and the logits [B,S,V]."""
    def loss(lora):
        logits = nnx.merge(graphdef, params, lora)(ids)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)), logits
    return jax.value_and_grad(loss, has_aux=True)(lora)


@pytest.fixture(scope="module")
def greedy(models):
    """(prompt [P], the FP8 model's greedy tokens [N]) through the sampler (chunked prefill, cached decode)."""
    prompt = np.random.default_rng(5).integers(0, CFG.vocab_size, PROMPT_LEN)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    tokens = Sampler(models["fp8"], chunk_size=32, capacity_multiple=64).sample(prompt.tolist(), params).tokens
    assert tokens.shape == (1, NEW_TOKENS)
    return prompt, tokens[0]


@pytest.fixture(scope="module")
def results(models, greedy):
    """{name: (logits [2,S,V], LoRA gradients)} on two rows: prompt + the FP8 greedy tokens, and random ids."""
    prompt, tokens = greedy
    other = np.random.default_rng(7).integers(0, CFG.vocab_size, PROMPT_LEN + NEW_TOKENS)
    ids = jnp.asarray(np.stack([np.concatenate([prompt, tokens]), other]), jnp.int32)
    out = {}
    for name, model in models.items():
        graphdef, params, lora = nnx.split(model, nnx.Param, LoRA)
        (_, logits), grads = _loss_and_grads(graphdef, params, lora, ids)
        out[name] = (np.asarray(logits), jax.tree.map(np.asarray, grads))
    return out


def test_fp8_logits_match_the_dequantized_model(results):
    got, want = results["fp8"][0], results["ref"][0]
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_RTOL * np.abs(want).max())
    # Informative (not a bound of ours): what e4m3 itself costs against the unquantized weights.
    original = results["original"][0]
    print(f"FP8 vs dequantized max |dlogit| {np.abs(got - want).max():.3g}; vs unquantized "
          f"{np.abs(got - original).max():.3g} of max |logit| {np.abs(original).max():.3g}")


def test_fp8_lora_gradients_match_the_dequantized_model(results):
    got, want = (jax.tree.leaves(results[name][1]) for name in ("fp8", "ref"))
    assert len(got) == len(want) and len(got) > 20  # every family's A and B
    flat_got, flat_want = np.concatenate([g.ravel() for g in got]), np.concatenate([w.ravel() for w in want])
    cosine = flat_got @ flat_want / (np.linalg.norm(flat_got) * np.linalg.norm(flat_want))
    assert cosine >= GRAD_COSINE, cosine
    assert all(np.abs(w).max() > 0 for w in want)  # every adapter gets a gradient (experts' through FP8 too)


def test_fp8_greedy_decode_matches_the_dequantized_model(greedy, results):
    """Each greedy token of the FP8 sampler is the dequantized model's argmax after the same prefix, so greedy
    decoding of either model gives these 16 tokens (the reference's own sampler path is tests/rollout's)."""
    _, tokens = greedy
    choices = results["ref"][0][0, PROMPT_LEN - 1:-1].argmax(-1)
    np.testing.assert_array_equal(tokens, choices)
    assert len(set(tokens.tolist())) > 2  # not a degenerate repeat
