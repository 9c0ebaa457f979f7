"""HF checkpoint I/O: loading HF-saved / fused / sharded checkpoints, saving for HF, errors, meshes.

Everything runs on real files in `tmp_path` against HF transformers' `GlmMoeDsaForCausalLM`. The
model is a 5-layer tiny config whose plan has a stacked segment with 2 repeats of a 2-layer unit
(dense+full, then [sparse+full, sparse+shared] x 2), so the layer -> (stack, repeat, slot) mapping
and IndexShare's missing indexer weights are both exercised. Whole-model parity across configs is
tests/test_parity_hf.py's job; here one config checks that the I/O preserves every number.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from flax import nnx
from hf_reference import hf_logits_and_topk, random_hf_model, save_hf

import glm52_jax
from glm52_jax import config
from glm52_jax.checkpoint import hf as hf_io
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.parallel.rules import axis_rules

# |ours - HF| logits of the shared fixture (wide random weights, max |logit| 2.2): measured 1.5e-6
# (2026-12-04), float32 rounding on both sides as in tests/test_parity_hf.py. Bound: ~6x that.
ATOL = 1e-5
INDEXER_TYPES = ("full", "full", "shared", "full", "shared")
SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


# ------------------------------------------------------------------------------------------------
# Helpers.


def make_cfg(**overrides) -> config.ModelConfig:
    base = dict(num_hidden_layers=5, indexer_types=INDEXER_TYPES, vocab_size=128)
    base.update(overrides)
    return config.tiny(**base)


def flat_params(model) -> dict[tuple, np.ndarray]:
    """Every parameter of our model as a host array, keyed by its nnx path."""
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def assert_params_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def our_logits(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


def read_tensors(path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint dir (single file or sharded), read with the reference library."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(safetensors.numpy.load_file(os.path.join(path, f)))
    return out


def write_ckpt(path, tensors: dict[str, np.ndarray], cfg: config.ModelConfig) -> str:
    """A single-file checkpoint dir written with the reference `safetensors` library."""
    os.makedirs(path, exist_ok=True)
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_json(os.path.join(path, "config.json"))
    return os.fspath(path)


def dir_digest(path) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(path))}


def hf_load(path, dtype=torch.float32):
    model, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        os.fspath(path), dtype=dtype, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), (kind, info[kind])
    return model.eval()


def hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def expected_ours(cfg, sd: dict[str, np.ndarray], plan) -> dict[tuple, np.ndarray]:
    """Our parameters from an HF in-memory state dict (fused experts), with the layout transforms
    written out independently of `checkpoint/hf.py`: linear weights [out, in] -> [in, out]; heads
    split out of fused projections; experts [E, out, in] -> [E, in, out]; stacked on 'layers'."""
    h, n, r, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    c, q, d, i_moe = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.hidden_size, cfg.moe_intermediate_size
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    per_layer: dict[int, dict[tuple, np.ndarray]] = {}
    for layer in range(cfg.num_hidden_layers):
        g = lambda name, layer=layer: sd[f"model.layers.{layer}.{name}"]  # noqa: E731
        kv_b = g("self_attn.kv_b_proj.weight").reshape(h, n + v, c)
        p = {
            ("input_layernorm", "weight"): g("input_layernorm.weight"),
            ("post_attention_layernorm", "weight"): g("post_attention_layernorm.weight"),
            ("self_attn", "q_a_proj"): g("self_attn.q_a_proj.weight").T,
            ("self_attn", "q_a_layernorm", "weight"): g("self_attn.q_a_layernorm.weight"),
            ("self_attn", "q_b_proj"): g("self_attn.q_b_proj.weight").reshape(h, n + r, q).transpose(2, 0, 1),
            ("self_attn", "kv_a_proj_with_mqa"): g("self_attn.kv_a_proj_with_mqa.weight").T,
            ("self_attn", "kv_a_layernorm", "weight"): g("self_attn.kv_a_layernorm.weight"),
            ("self_attn", "w_uk"): kv_b[:, :n].transpose(2, 0, 1),
            ("self_attn", "w_uv"): kv_b[:, n:].transpose(2, 0, 1),
            ("self_attn", "o_proj"): g("self_attn.o_proj.weight").reshape(d, h, v).transpose(1, 2, 0),
        }
        if cfg.indexer_types[layer] == "full":
            p.update({
                ("self_attn", "indexer", "wq_b"):
                    g("self_attn.indexer.wq_b.weight").reshape(ih, idim, q).transpose(2, 0, 1),
                ("self_attn", "indexer", "wk"): g("self_attn.indexer.wk.weight").T,
                ("self_attn", "indexer", "k_norm", "weight"): g("self_attn.indexer.k_norm.weight"),
                ("self_attn", "indexer", "k_norm", "bias"): g("self_attn.indexer.k_norm.bias"),
                ("self_attn", "indexer", "weights_proj"): g("self_attn.indexer.weights_proj.weight").T,
            })
        if cfg.mlp_layer_types[layer] == "dense":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                p[("mlp", proj)] = g(f"mlp.{proj}.weight").T
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                p[("mlp", "shared_experts", proj)] = g(f"mlp.shared_experts.{proj}.weight").T
            gate_up = g("mlp.experts.gate_up_proj")  # [E, 2I, D]
            p[("mlp", "w_gate")] = gate_up[:, :i_moe].transpose(0, 2, 1)
            p[("mlp", "w_up")] = gate_up[:, i_moe:].transpose(0, 2, 1)
            p[("mlp", "w_down")] = g("mlp.experts.down_proj").transpose(0, 2, 1)  # [E, D, I] -> [E, I, D]
            p[("mlp", "router")] = g("mlp.gate.weight").T
            p[("mlp", "e_score_correction_bias")] = g("mlp.gate.e_score_correction_bias")
        per_layer[layer] = p
    out = {("embed_tokens",): sd["model.embed_tokens.weight"], ("norm", "weight"): sd["model.norm.weight"],
           ("lm_head",): sd["lm_head.weight"].T}
    for s, seg in enumerate(plan):
        for slot in range(len(seg.unit)):
            layers = [seg.start + rep * len(seg.unit) + slot for rep in range(seg.repeats)]
            for rel in per_layer[layers[0]]:
                out[("stacks", s, "layers", slot) + rel] = np.stack([per_layer[x][rel] for x in layers])
    return out


# ------------------------------------------------------------------------------------------------
# Shared fixtures: one random HF model, saved by HF, and our model loaded from it.


@pytest.fixture(scope="module")
def cfg():
    return make_cfg()


@pytest.fixture(scope="module")
def ids(cfg):
    return np.random.RandomState(0).randint(0, cfg.vocab_size, size=(2, 12))


@pytest.fixture(scope="module")
def hf_model(cfg):
    return random_hf_model(cfg, seed=0)


@pytest.fixture(scope="module")
def hf_ref_logits(hf_model, ids):
    return hf_logits_and_topk(hf_model, ids)[0]


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    """HF `save_pretrained` output: per-expert tensor names."""
    return save_hf(hf_model, tmp_path_factory.mktemp("hf_saved"))


@pytest.fixture(scope="module")
def hf_tensors(hf_dir):
    return read_tensors(hf_dir)


@pytest.fixture(scope="module")
def loaded(hf_dir):
    return glm52_jax.load_pretrained(hf_dir, dtype=jnp.float32)


@pytest.fixture(scope="module")
def loaded_params(loaded):
    return flat_params(loaded)


@pytest.fixture(scope="module")
def loaded_logits(loaded, ids):
    return our_logits(loaded, ids)


# ------------------------------------------------------------------------------------------------
# 1. Loading HF's own checkpoint.


def test_hf_saved_checkpoint_uses_per_expert_names(hf_tensors, cfg):
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in hf_tensors
    assert not any(k.endswith("gate_up_proj") for k in hf_tensors)
    # IndexShare: 'shared' layers have no indexer weights at all.
    assert not any(k.startswith("model.layers.2.self_attn.indexer.") for k in hf_tensors)
    assert set(hf_tensors) == set(hf_io.expected_tensors(cfg))


def test_load_hf_checkpoint_reproduces_every_parameter(cfg, hf_model, loaded, loaded_params):
    plan = loaded.segments_plan
    assert [(s.start, len(s.unit), s.repeats) for s in plan] == [(0, 1, 1), (1, 2, 2)]
    want = expected_ours(cfg, hf_state(hf_model), plan)
    assert_params_identical(loaded_params, {k: v.astype(np.float32) for k, v in want.items()})
    # Spot check of the stacked layout, spelled out: layer 3 is stack 1, repeat 1, slot 0.
    np.testing.assert_array_equal(
        loaded_params[("stacks", 1, "layers", 0, "self_attn", "q_a_proj")][1],
        hf_model.model.layers[3].self_attn.q_a_proj.weight.detach().numpy().T)


def test_load_hf_checkpoint_logits_match_hf(loaded_logits, hf_ref_logits):
    assert loaded_logits.shape == hf_ref_logits.shape
    assert np.std(hf_ref_logits) > 0.1  # logits are not trivially small
    np.testing.assert_allclose(loaded_logits, hf_ref_logits, atol=ATOL, rtol=0)


def test_load_bf16_dtype_rounds_but_keeps_float32_router(hf_dir, loaded_params):
    model = glm52_jax.load_pretrained(hf_dir, dtype=jnp.bfloat16)
    params = flat_params(model)
    router = ("stacks", 1, "layers", 0, "mlp", "router")
    assert params[router].dtype == np.float32
    np.testing.assert_array_equal(params[router], loaded_params[router])
    key = ("stacks", 1, "layers", 1, "mlp", "w_down")
    assert params[key].dtype == jnp.bfloat16
    np.testing.assert_array_equal(params[key], loaded_params[key].astype(jnp.bfloat16))


# ------------------------------------------------------------------------------------------------
# 2. Sharded checkpoints written by us, read by us and by HF.


def test_sharded_save_roundtrip_and_hf_load(tmp_path, loaded, loaded_params, hf_model, hf_tensors, ids,
                                            loaded_logits):
    path = tmp_path / "sharded"
    glm52_jax.save_pretrained(loaded, path, max_shard_bytes=64 * 1024)
    files = sorted(os.listdir(path))
    shards = [f for f in files if SHARD_RE.fullmatch(f)]
    assert len(shards) >= 3
    assert files == sorted(shards + ["config.json", hf_io.INDEX_FILE])
    n = len(shards)
    assert [SHARD_RE.fullmatch(f).groups() for f in shards] == [(f"{k:05d}", f"{n:05d}") for k in range(1, n + 1)]
    index = json.loads((path / hf_io.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(hf_tensors)
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        st = SafetensorsFile(path / shard)
        assert {k for k, f in index["weight_map"].items() if f == shard} == set(st.keys())
        assert sum(t.end - t.begin for t in st.tensors.values()) <= 64 * 1024 or len(st.keys()) == 1
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in hf_tensors.values())

    # Our reload is bitwise identical; the tensors are HF's original ones, bit for bit.
    assert_params_identical(flat_params(glm52_jax.load_pretrained(path, dtype=jnp.float32)), loaded_params)
    ours = read_tensors(path)
    assert ours.keys() == hf_tensors.keys()
    for k in ours:
        np.testing.assert_array_equal(ours[k], hf_tensors[k], err_msg=k)

    # HF reads the sharded checkpoint with nothing missing or left over, to the same model.
    reloaded = hf_load(path)
    want = hf_state(hf_model)
    got = hf_state(reloaded)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    logits = hf_logits_and_topk(reloaded, ids)[0]
    np.testing.assert_allclose(logits, loaded_logits, atol=ATOL, rtol=0)


def test_save_single_file_below_limit(tmp_path, loaded):
    glm52_jax.save_pretrained(loaded, tmp_path / "single")
    assert sorted(os.listdir(tmp_path / "single")) == ["config.json", "model.safetensors"]
    saved = config.ModelConfig.from_json_file(tmp_path / "single" / "config.json")
    assert saved == loaded.cfg


def test_save_replaces_other_layout(tmp_path, loaded, loaded_params):
    path = tmp_path / "ckpt"
    glm52_jax.save_pretrained(loaded, path, max_shard_bytes=64 * 1024)
    (path / "README.md").write_text("keep me")
    glm52_jax.save_pretrained(loaded, path)  # single file now: shards and index must go
    assert sorted(os.listdir(path)) == ["README.md", "config.json", "model.safetensors"]
    glm52_jax.save_pretrained(loaded, path, max_shard_bytes=128 * 1024)  # and back
    files = sorted(os.listdir(path))
    assert "model.safetensors" not in files and hf_io.INDEX_FILE in files and "README.md" in files
    assert_params_identical(flat_params(glm52_jax.load_pretrained(path, dtype=jnp.float32)), loaded_params)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        glm52_jax.save_pretrained(loaded, path, max_shard_bytes=0)


# ------------------------------------------------------------------------------------------------
# 3. HF's fused in-memory expert layout.


@pytest.fixture(scope="module")
def fused_dir(hf_model, cfg, tmp_path_factory):
    path = tmp_path_factory.mktemp("fused")
    sd = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    assert tuple(sd["model.layers.1.mlp.experts.gate_up_proj"].shape) == (
        cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert tuple(sd["model.layers.1.mlp.experts.down_proj"].shape) == (
        cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    safetensors.torch.save_file(sd, os.fspath(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_json(path / "config.json")
    return os.fspath(path)


def test_fused_expert_layout_loads_identically(fused_dir, loaded_params):
    # Bitwise-identical parameters: the logits are then those of the per-expert load.
    assert_params_identical(flat_params(glm52_jax.load_pretrained(fused_dir, dtype=jnp.float32)), loaded_params)


def test_fused_layout_missing_down_proj(fused_dir, cfg, tmp_path):
    tensors = read_tensors(fused_dir)
    del tensors["model.layers.4.mlp.experts.down_proj"]
    path = write_ckpt(tmp_path / "bad", tensors, cfg)
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.4\.mlp\.experts\.down_proj"):
        glm52_jax.load_pretrained(path, dtype=jnp.float32)


# ------------------------------------------------------------------------------------------------
# 4. Saving our own models for HF.


def test_save_random_init_float32_hf_logits_match(tmp_path, ids):
    cfg = make_cfg()
    model = glm52_jax.GlmMoeDsa(cfg, glm52_jax.ModelOptions(param_dtype=jnp.float32), rngs=nnx.Rngs(0))
    glm52_jax.save_pretrained(model, tmp_path / "ours")
    ref = our_logits(model, ids)
    assert np.std(ref) > 1e-3
    hf = hf_load(tmp_path / "ours")
    got = hf_logits_and_topk(hf, ids)[0]
    # Random init has small logits (max |logit| 0.56), and float32 rounding scales with them, so the
    # bound is relative to that scale: measured 3.1e-7 = 5.6e-7 of max |logit| (2026-12-04; the
    # HF-parity cases reach 1.2e-6 of theirs). 4e-6 of the scale is 2.3e-6 here, ~7x the measured.
    # (The former min(1e-4, 1e-3 x scale) was 1e-4 here: 300x the measured error.)
    np.testing.assert_allclose(got, ref, atol=4e-6 * np.abs(ref).max(), rtol=0)


def test_save_bf16_writes_bf16_tensors_hf_loads(tmp_path):
    cfg = make_cfg()
    model = glm52_jax.GlmMoeDsa(cfg, glm52_jax.ModelOptions(param_dtype=jnp.bfloat16), rngs=nnx.Rngs(1))
    path = tmp_path / "bf16"
    glm52_jax.save_pretrained(model, path)
    st = SafetensorsFile(path / "model.safetensors")
    assert set(st.keys()) == set(hf_io.expected_tensors(cfg))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_b_proj.weight",
                 "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.4.mlp.experts.5.down_proj.weight",
                 "model.layers.2.mlp.shared_experts.up_proj.weight"):
        assert st.tensors[name].dtype == "BF16", name
    # The float32 exceptions stay float32 on disk.
    assert st.tensors["model.layers.1.mlp.gate.weight"].dtype == "F32"
    assert st.tensors["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == "F32"
    assert st.get("model.embed_tokens.weight").dtype == ml_dtypes.bfloat16
    # HF reads it (nothing missing or unexpected); its values, written back, load to our params.
    hf = hf_load(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "via_hf")
    back = glm52_jax.load_pretrained(tmp_path / "via_hf", dtype=jnp.bfloat16)
    assert_params_identical(flat_params(back), flat_params(model))


def test_tied_embeddings_roundtrip(tmp_path):
    cfg = make_cfg(tie_word_embeddings=True, num_hidden_layers=2, indexer_types=("full", "shared"))
    model = glm52_jax.GlmMoeDsa(cfg, glm52_jax.ModelOptions(param_dtype=jnp.float32), rngs=nnx.Rngs(2))
    glm52_jax.save_pretrained(model, tmp_path / "tied")
    assert "lm_head.weight" not in SafetensorsFile(tmp_path / "tied" / "model.safetensors").keys()
    back = glm52_jax.load_pretrained(tmp_path / "tied", dtype=jnp.float32)
    assert back.cfg.tie_word_embeddings
    assert_params_identical(flat_params(back), flat_params(model))


# ------------------------------------------------------------------------------------------------
# 5. An interrupted save leaves the previous checkpoint intact.


@pytest.mark.parametrize("max_shard_bytes", [64 * 1024, 5 * 2**30])
def test_interrupted_save_keeps_old_checkpoint(tmp_path, monkeypatch, loaded, loaded_params, max_shard_bytes):
    path = tmp_path / "ckpt"
    glm52_jax.save_pretrained(loaded, path, max_shard_bytes=128 * 1024)
    before = dir_digest(path)
    from glm52_jax.checkpoint import hf_save
    real_write = hf_save.write_safetensors
    calls = []

    def crashing_write(fpath, tensors, *args, **kwargs):
        calls.append(fpath)
        if len(calls) == 1 and max_shard_bytes < 2**20:
            return real_write(fpath, tensors, *args, **kwargs)  # the first shard completes
        with open(fpath, "wb") as f:  # the next one is cut off mid-write
            f.write(b"\x10\x00\x00\x00")
        raise OSError("disk full")

    monkeypatch.setattr(hf_save, "write_safetensors", crashing_write)
    other = glm52_jax.GlmMoeDsa(loaded.cfg, glm52_jax.ModelOptions(param_dtype=jnp.float32), rngs=nnx.Rngs(3))
    with pytest.raises(OSError, match="disk full"):
        glm52_jax.save_pretrained(other, path, max_shard_bytes=max_shard_bytes)
    assert len(calls) == (2 if max_shard_bytes < 2**20 else 1)
    assert dir_digest(path) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind
    monkeypatch.undo()
    assert_params_identical(flat_params(glm52_jax.load_pretrained(path, dtype=jnp.float32)), loaded_params)


# ------------------------------------------------------------------------------------------------
# 6. Multi-token-prediction layers.


def _with_mtp_layer(tensors, cfg, layer):
    """Adds a GLM-5-style MTP layer: a copy of the last decoder layer plus its own projections."""
    out = dict(tensors)
    last = f"model.layers.{cfg.num_hidden_layers - 1}."
    for k, v in tensors.items():
        if k.startswith(last):
            out[f"model.layers.{layer}." + k[len(last):]] = v
    d = cfg.hidden_size
    out.update({f"model.layers.{layer}.eh_proj.weight": np.ones((d, 2 * d), np.float32),
                f"model.layers.{layer}.enorm.weight": np.ones((d,), np.float32),
                f"model.layers.{layer}.hnorm.weight": np.ones((d,), np.float32),
                f"model.layers.{layer}.shared_head.norm.weight": np.ones((d,), np.float32)})
    return out


def test_mtp_layer_is_skipped(tmp_path, hf_tensors, cfg, loaded_params):
    tensors = _with_mtp_layer(hf_tensors, cfg, cfg.num_hidden_layers)
    path = write_ckpt(tmp_path / "mtp", tensors, cfg.replace(num_nextn_predict_layers=1))
    model = glm52_jax.load_pretrained(path, dtype=jnp.float32)
    assert model.cfg.num_nextn_predict_layers == 1
    assert_params_identical(flat_params(model), loaded_params)


def test_mtp_layer_without_config_is_an_error(tmp_path, hf_tensors, cfg):
    path = write_ckpt(tmp_path / "mtp", _with_mtp_layer(hf_tensors, cfg, cfg.num_hidden_layers), cfg)
    with pytest.raises(ValueError, match=r"config\.json does not match the weights.*num_hidden_layers=5.*\[5\]"):
        glm52_jax.load_pretrained(path, dtype=jnp.float32)
    # One MTP layer declared, but tensors for a second one: still an error.
    tensors = _with_mtp_layer(_with_mtp_layer(hf_tensors, cfg, 5), cfg, 6)
    path = write_ckpt(tmp_path / "mtp2", tensors, cfg.replace(num_nextn_predict_layers=1))
    with pytest.raises(ValueError, match=r"config\.json does not match the weights.*\[6\]"):
        glm52_jax.load_pretrained(path, dtype=jnp.float32)


# ------------------------------------------------------------------------------------------------
# 7. Errors name the tensor or the problem.


def _load(path):
    return glm52_jax.load_pretrained(path, dtype=jnp.float32)


def _error_case(tmp_path, tensors, cfg, match):
    path = write_ckpt(tmp_path / "bad", tensors, cfg)
    with pytest.raises(ValueError, match=match):
        _load(path)


def test_error_missing_tensor(tmp_path, hf_tensors, cfg):
    tensors = dict(hf_tensors)
    del tensors["model.layers.3.self_attn.kv_b_proj.weight"]
    _error_case(tmp_path, tensors, cfg, r"missing tensor.*'model\.layers\.3\.self_attn\.kv_b_proj\.weight'")


def test_error_missing_expert(tmp_path, hf_tensors, cfg):
    tensors = dict(hf_tensors)
    del tensors["model.layers.2.mlp.experts.6.up_proj.weight"]
    _error_case(tmp_path, tensors, cfg, r"missing tensor.*'model\.layers\.2\.mlp\.experts\.6\.up_proj\.weight'")


def test_error_unexpected_tensor(tmp_path, hf_tensors, cfg):
    tensors = dict(hf_tensors, **{"model.layers.1.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})
    _error_case(tmp_path, tensors, cfg, r"unexpected tensor.*'model\.layers\.1\.self_attn\.rotary_emb\.inv_freq'")


def test_error_shape_mismatch(tmp_path, hf_tensors, cfg):
    name = "model.layers.4.self_attn.o_proj.weight"
    tensors = dict(hf_tensors, **{name: hf_tensors[name][:, :-1]})
    _error_case(tmp_path, tensors, cfg, rf"tensor '{re.escape(name)}' has shape \(64, 127\).*\(64, 128\)")


def test_error_dtype_mismatch(tmp_path, hf_tensors, cfg):
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    tensors = dict(hf_tensors, **{name: np.zeros(hf_tensors[name].shape, np.int32)})
    _error_case(tmp_path, tensors, cfg, rf"tensor '{re.escape(name)}' has dtype I32.*float")


def test_error_config_hidden_size_mismatch(tmp_path, hf_tensors, cfg):
    _error_case(tmp_path, hf_tensors, cfg.replace(hidden_size=96),
                r"config\.json does not match the weights: tensor 'model\.embed_tokens\.weight' has shape")


def test_error_config_indexer_types_mismatch(tmp_path, hf_tensors, cfg):
    # Layer 3 declared 'shared', but the weights carry its indexer.
    _error_case(tmp_path, hf_tensors, cfg.replace(indexer_types=("full", "full", "shared", "shared", "shared")),
                r"unexpected tensor.*'model\.layers\.3\.self_attn\.indexer\.")
    # Layer 2 declared 'full', but the weights have no indexer for it.
    _error_case(tmp_path, hf_tensors, cfg.replace(indexer_types=("full",) * 4 + ("shared",)),
                r"missing tensor.*'model\.layers\.2\.self_attn\.indexer\.")


def test_error_config_first_k_dense_mismatch(tmp_path, hf_tensors, cfg):
    _error_case(tmp_path, hf_tensors, cfg.replace(mlp_layer_types=("dense", "dense", "sparse", "sparse", "sparse")),
                r"missing tensor.*'model\.layers\.1\.mlp\.down_proj\.weight'")


def test_error_truncated_file(tmp_path, hf_dir):
    path = tmp_path / "cut"
    path.mkdir()
    (path / "config.json").write_bytes(open(os.path.join(hf_dir, "config.json"), "rb").read())
    data = open(os.path.join(hf_dir, "model.safetensors"), "rb").read()
    (path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated"):
        _load(path)
    (path / "model.safetensors").write_bytes(data[:5])  # not even a header length
    with pytest.raises(ValueError, match="truncated"):
        _load(path)
    (path / "model.safetensors").write_bytes(data[:200])  # header cut off
    with pytest.raises(ValueError, match="truncated or corrupt"):
        _load(path)


def test_error_corrupt_byte_range(tmp_path, hf_tensors, cfg):
    """A header whose byte range does not fit the tensor's shape is caught when the tensor is read."""
    path = write_ckpt(tmp_path / "bad", hf_tensors, cfg)
    fpath = os.path.join(path, "model.safetensors")
    raw = open(fpath, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = "model.layers.0.self_attn.q_a_proj.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 4]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (n - len(blob))
    assert len(blob) == n
    open(fpath, "wb").write(raw[:8] + blob + raw[8 + n:])
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}' byte range does not match"):
        _load(path)


def test_error_fp8_scales_without_quantization_config(tmp_path, hf_tensors, cfg):
    """FP8 checkpoints load (tests/checkpoint/test_hf_fp8.py), but only with config.json's quantization_config."""
    name = "model.layers.1.self_attn.q_a_proj.weight"
    tensors = dict(hf_tensors, **{name: hf_tensors[name].astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
                                  name + "_scale_inv": np.ones((1, 1), np.float32)})
    _error_case(tmp_path, tensors, cfg, rf"tensor '{re.escape(name)}_scale_inv' is an FP8 block scale, but "
                                        r"config.json has no quantization_config")


def test_error_no_safetensors(tmp_path, cfg):
    path = tmp_path / "empty"
    path.mkdir()
    cfg.save_json(path / "config.json")
    with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json found"):
        _load(path)


def test_error_index_lists_missing_shard(tmp_path, loaded):
    path = tmp_path / "sharded"
    glm52_jax.save_pretrained(loaded, path, max_shard_bytes=64 * 1024)
    shard = sorted(f for f in os.listdir(path) if SHARD_RE.fullmatch(f))[1]
    os.remove(path / shard)
    with pytest.raises(ValueError, match=rf"lists shard '{shard}', which does not exist"):
        _load(path)


def test_error_index_lists_tensor_not_in_shard(tmp_path, loaded):
    path = tmp_path / "sharded"
    glm52_jax.save_pretrained(loaded, path, max_shard_bytes=64 * 1024)
    index = json.loads((path / hf_io.INDEX_FILE).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.9.mlp.gate.weight"] = first
    (path / hf_io.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'model\.layers\.9\.mlp\.gate\.weight' is listed in .* but not stored"):
        _load(path)
    (path / hf_io.INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        _load(path)


def test_error_config_missing(tmp_path, hf_tensors, cfg):
    path = write_ckpt(tmp_path / "noconf", hf_tensors, cfg)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(ValueError, match=r"config file .*config\.json' does not exist"):
        _load(path)


# ------------------------------------------------------------------------------------------------
# 8. Loading straight onto a device mesh.


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("context", "expert"))


EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_load_onto_mesh_shards_experts(mesh, hf_dir, fused_dir, loaded_params, layout):
    path = hf_dir if layout == "per_expert" else fused_dir
    model = glm52_jax.load_pretrained(path, dtype=jnp.float32, shardings=mesh)
    seen_experts = 0
    for key, var in nnx.to_flat_state(nnx.state(model)):
        arr = var.get_value()
        assert isinstance(arr.sharding, jax.sharding.NamedSharding), key
        assert arr.sharding.mesh.shape == mesh.shape
        spec = tuple(arr.sharding.spec) + (None,) * (arr.ndim - len(tuple(arr.sharding.spec)))
        if key[-2:-1] == ("mlp",) and key[-1] in EXPERT_PARAMS:
            seen_experts += 1
            assert spec == (None, "expert", None, None), key
            shard_shapes = {s.data.shape for s in arr.addressable_shards}
            assert shard_shapes == {(arr.shape[0], arr.shape[1] // 4) + arr.shape[2:]}, key
        else:
            assert spec == (None,) * arr.ndim, key  # nothing else has a rule on this mesh
        np.testing.assert_array_equal(np.asarray(arr), loaded_params[key], err_msg=str(key))
    assert seen_experts == 3 * 2  # stack 1 has two slots, each with gate/up/down


def test_load_onto_mesh_with_sliced_inner_dims(mesh, fused_dir, loaded_params):
    """Custom rules that shard inner dims too: every device's callback reads only its slice."""
    rules = (("experts", "expert"), ("expert_mlp", "context"), ("heads", "context"), ("vocab", "expert"),
             ("q_lora", "expert"))
    with axis_rules(rules):
        model = glm52_jax.load_pretrained(fused_dir, dtype=jnp.float32, shardings=mesh)
    params = {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    P = jax.sharding.PartitionSpec
    assert params[("stacks", 1, "layers", 1, "mlp", "w_down")].sharding.spec == P(None, "expert", "context", None)
    assert params[("stacks", 1, "layers", 0, "mlp", "w_gate")].sharding.spec == P(None, "expert", None, "context")
    assert params[("stacks", 1, "layers", 0, "self_attn", "q_b_proj")].sharding.spec == P(None, "expert", "context",
                                                                                          None)
    assert params[("lm_head",)].sharding.spec == P(None, "expert")
    for key, arr in params.items():
        np.testing.assert_array_equal(np.asarray(arr), loaded_params[key], err_msg=str(key))


def test_load_with_lora_options_attaches_fresh_adapters(tmp_path):
    from glm52_jax.model.lora import LoRA, LoRAConfig

    cfg = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
    base = glm52_jax.GlmMoeDsa(cfg, glm52_jax.ModelOptions(param_dtype=jnp.float32), rngs=nnx.Rngs(0))
    glm52_jax.save_pretrained(base, tmp_path / "ck")
    opts = glm52_jax.ModelOptions(param_dtype=jnp.float32, lora=LoRAConfig(rank=4, alpha=8.0))
    model = glm52_jax.load_pretrained(tmp_path / "ck", dtype=jnp.float32, options=opts)
    adapters = jax.tree.leaves(nnx.state(model, LoRA))
    norms = [float(jnp.abs(a).max()) for a in adapters]
    assert any(n > 0 for n in norms) and any(n == 0 for n in norms)  # A random, B zero
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    # B = 0: the adapted model computes the base model's logits.
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(base(ids)), atol=1e-6)


def test_local_slice_inside_a_mesh_context():
    """Export code may run under `jax.set_mesh` (parity's torch bridge does): a replicated and a sharded array
    are both sliced, with the same values as outside it."""
    from jax.sharding import NamedSharding, PartitionSpec

    from glm52_jax.checkpoint.hf import local_slice

    mesh = jax.make_mesh((8,), ("x",))
    values = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4, 8, 3)
    replicated = jax.device_put(values, NamedSharding(mesh, PartitionSpec()))
    sharded = jax.device_put(values, NamedSharding(mesh, PartitionSpec(None, "x")))
    with jax.set_mesh(mesh):
        for x in (replicated, sharded):
            np.testing.assert_array_equal(np.asarray(local_slice(x, (2,))), values[2])
