"""Saving a model with FP8 base weights (`checkpoint.hf.save_pretrained`): merged with its LoRA adapters,
dequantized in the parameter dtype or re-quantized to the release format.

The FP8 checkpoint is written by `tests/fp8_checkpoint.py` (random float32 weights, the DeepSeek-V3 block rule,
blocks 16 x 12: partial blocks, heads across block edges); the adapters are random (every B nonzero). The
reference for each re-quantized tensor is the float32 merge as saved, quantized by the tests' own quantizer
(`fc.quantize`), so the two must agree bit for bit. `--mode=export` end to end: tests/rl/test_export_fp8.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import fp8_checkpoint as fc
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from lora_utils import random_adapters

import glm52_jax
from glm52_jax import config
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.model import fp8
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.transformer import GlmMoeDsa

CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "full"), first_k_dense_replace=0, vocab_size=128)
BLOCK = (16, 12)
OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8, remat=False, lora=LoRAConfig(rank=4, alpha=8.0))
# The float32 merge holds each weight rounded once to float32 (`value x scale + delta`); the FP8 + LoRA model adds
# the same terms in another order (x W + (x A) B): float32 sums of <= 128 terms associated differently, ~sqrt(K) x
# 6e-8 relative per dot, ~1e-6 after a few layers: bound 1e-5 of the largest |logit| (test_hf_fp8.py's, fixed
# before the first run).
LOGIT_RTOL = 1e-5


def _with_lora(path, dtype):
    """The checkpoint at `path` in `dtype` with the random adapters (the same arrays for every dtype)."""
    options = dataclasses.replace(OPTS, param_dtype=dtype)
    graphdef, _, shapes = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(CFG, options, rngs=nnx.Rngs(0))), nnx.Param,
                                    LoRA)
    base = glm52_jax.load_pretrained(path, dtype=dtype, options=dataclasses.replace(options, lora=None))
    return nnx.merge(graphdef, nnx.state(base, nnx.Param), random_adapters(shapes, seed=3))


def _fp8_keys(model) -> set[tuple]:
    return {k for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if isinstance(v.get_value(), fp8.Fp8Weight)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the FP8 + LoRA model, the float32 merge's dir, the FP8 merge's dir, the FP8 checkpoint's dir)."""
    root = tmp_path_factory.mktemp("fp8_save")
    source = fc.write(root / "fp8", CFG, fc.fp8_tensors(fc.random_tensors(CFG, seed=1), BLOCK), fc.quant_config(BLOCK))
    model = _with_lora(source, jnp.float32)
    glm52_jax.save_pretrained(model, root / "merged", merge_adapters=True)
    glm52_jax.save_pretrained(model, root / "merged_fp8", merge_adapters=True, quantization=fc.quant_config(BLOCK))
    return model, root / "merged", root / "merged_fp8", source


def test_merged_float32_has_the_fp8_lora_models_logits(saved):
    model, merged, _, _ = saved
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    tensors = safetensors.numpy.load_file(merged / "model.safetensors")
    assert {a.dtype for a in tensors.values()} == {np.dtype(np.float32)} and not any("scale" in n for n in tensors)
    loaded = glm52_jax.load_pretrained(merged, dtype=jnp.float32)
    assert not _fp8_keys(loaded) and _fp8_keys(model)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 40)), jnp.int32)
    want, got = np.asarray(model(ids)), np.asarray(loaded(ids))
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_RTOL * np.abs(want).max())
    # The adapters are in it: each adapted weight moved off the base's numbers.
    source = SafetensorsFile(Path(saved[3]) / "model.safetensors")
    for name in ("model.layers.1.self_attn.q_a_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
        base = fc.dequantize(source.get(name), source.get(name + "_scale_inv"), BLOCK)
        assert np.abs(tensors[name] - base).max() > 1e-3, name


def test_merged_fp8_is_the_float32_merge_quantized_and_loads_as_fp8(saved):
    model, merged, merged_fp8, _ = saved
    assert json.loads((merged_fp8 / "config.json").read_text())["quantization_config"] == fc.quant_config(BLOCK)
    want = safetensors.numpy.load_file(merged / "model.safetensors")
    stored = SafetensorsFile(merged_fp8 / "model.safetensors")
    names = set(stored.keys())
    fp8_names = {n for n in want if fc.is_quantized(n) and "weights_proj" not in n}  # as the base holds them
    assert names == set(want) | {n + "_scale_inv" for n in fp8_names}
    assert any(".experts." in n for n in fp8_names) and any("kv_b_proj" in n for n in fp8_names)
    for name, w in want.items():
        got = stored.get(name)
        if name in fp8_names:
            values, scales = fc.quantize(w, BLOCK)
            assert got.dtype == values.dtype
            np.testing.assert_array_equal(got.view(np.uint8), values.view(np.uint8), err_msg=name)
            np.testing.assert_array_equal(stored.get(name + "_scale_inv"), scales, err_msg=name)
        else:
            np.testing.assert_array_equal(got, w, err_msg=name)
    loaded = glm52_jax.load_pretrained(merged_fp8, dtype=jnp.float32)
    assert _fp8_keys(loaded) == _fp8_keys(model)


def test_bfloat16_merge_is_the_float32_merge_rounded_once(saved, tmp_path):
    """A bfloat16 model on the same FP8 base and adapters writes each merged FP8 weight as the float32 merge rounded
    to bfloat16 (one rounding of `value x scale + delta`), bit for bit."""
    _, merged, _, source = saved
    glm52_jax.save_pretrained(_with_lora(source, jnp.bfloat16), tmp_path / "bf16", merge_adapters=True)
    got = SafetensorsFile(tmp_path / "bf16" / "model.safetensors")
    want = safetensors.numpy.load_file(merged / "model.safetensors")
    fp8_names = [n for n in want if fc.is_quantized(n) and "weights_proj" not in n]
    assert set(got.keys()) == set(want) and len(fp8_names) > 20
    for name in fp8_names:
        g = got.get(name)
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(g.view(np.uint16), want[name].astype(jnp.bfloat16).view(np.uint16),
                                      err_msg=name)


def test_quantized_save_needs_fp8_weights(saved, tmp_path):
    plain = glm52_jax.load_pretrained(saved[1], dtype=jnp.float32)
    with pytest.raises(ValueError, match="a quantization config was given, but the model has no FP8 base weights"):
        glm52_jax.save_pretrained(plain, tmp_path / "x", quantization=fc.quant_config(BLOCK))
    assert not (tmp_path / "x").exists()
