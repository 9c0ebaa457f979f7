"""ModelConfig: GLM-5.2 preset, HF config.json round trips, parity with HF GlmMoeDsaConfig, errors."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import transformers

from glm52_jax import config, positions

REPO = Path(__file__).resolve().parents[1]
SCALING_2M = REPO / "configs" / "glm52_2m_yarn.json"
FACTOR_2M = 2.0000152587890625  # 2097168 / 1048576
PRESETS = {"tiny": config.tiny, "glm52": config.glm52}
# Fields compared one by one against HF (lists, rope and eos are compared separately).
SCALAR_FIELDS = [f.name for f in dataclasses.fields(config.ModelConfig)
                 if f.name not in ("rope", "extra", "eos_token_id", "indexer_types", "mlp_layer_types")]


# -- helpers -------------------------------------------------------------------------------------


def hf_from_ours(cfg: config.ModelConfig) -> transformers.GlmMoeDsaConfig:
    """HF's config built from our `to_hf_dict()` (minus the file-level keys HF sets itself)."""
    d = cfg.to_hf_dict()
    del d["architectures"], d["model_type"]
    return transformers.GlmMoeDsaConfig(**d)


def hf_raw(**changes):
    """tiny()'s config.json dict with `changes` applied (a None value deletes the key)."""
    raw = config.tiny().to_hf_dict()
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None or k not in changes}


def eos_tuple(eos):
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def indexer_layers(cfg, kind):
    return [i for i, t in enumerate(cfg.indexer_types) if t == kind]


# -- GLM-5.2 preset --------------------------------------------------------------------------------


def test_glm52_layer_schedule():
    c = config.glm52()
    assert c.num_hidden_layers == 78
    assert len(c.indexer_types) == 78 and len(c.mlp_layer_types) == 78
    assert indexer_layers(c, "full") == [0, 1, 2] + list(range(6, 75, 4))
    assert len(indexer_layers(c, "full")) == 21
    assert len(indexer_layers(c, "shared")) == 57
    assert c.indexer_types[74:] == ("full", "shared", "shared", "shared")
    assert c.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 75


def test_glm52_positions_and_tokens():
    c = config.glm52()
    assert c.max_position_embeddings == 1_048_576
    assert c.rope == positions.RopeParameters(rope_type="default", rope_theta=8_000_000.0)
    assert c.rope.to_dict() == {"rope_type": "default", "rope_theta": 8e6}
    assert c.qk_head_dim == 256
    assert c.softmax_scale == 256 ** -0.5
    assert c.pad_token_id == 154820
    assert c.eos_token_id == (154820, 154827, 154829)
    assert c.num_nextn_predict_layers == 1
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 8, 1, 1)


def test_tiny_has_every_feature():
    c = config.tiny()
    assert c.indexer_types == ("full", "full", "shared", "full", "shared", "full")
    assert c.mlp_layer_types == ("dense",) + ("sparse",) * 5
    assert c.n_group == 2 and c.topk_group == 1
    assert config.tiny(hidden_size=128).hidden_size == 128


def test_derived_lists_when_not_given():
    c = config.tiny(indexer_types=(), mlp_layer_types=(), first_k_dense_replace=2)
    assert c.indexer_types == ("full",) * 6  # HF default schedule: freq 1 -> every layer full
    assert c.mlp_layer_types == ("dense", "dense") + ("sparse",) * 4
    assert config.tiny(first_k_dense_replace=9, mlp_layer_types=()).mlp_layer_types == ("dense",) * 6


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_hf_dict_round_trip(name):
    c = PRESETS[name]()
    d = c.to_hf_dict()
    assert d["architectures"] == ["GlmMoeDsaForCausalLM"] and d["model_type"] == "glm_moe_dsa"
    assert config.ModelConfig.from_hf_dict(d) == c


@pytest.mark.parametrize("name", PRESETS)
def test_json_file_round_trip(name, tmp_path):
    c = PRESETS[name]()
    path = tmp_path / "config.json"
    c.save_json(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no .tmp left behind
    assert json.loads(path.read_text()) == json.loads(json.dumps(c.to_hf_dict()))
    assert config.ModelConfig.from_json_file(path) == c
    assert config.ModelConfig.from_json_file(str(path)) == c


# -- agreement with HF GlmMoeDsaConfig -----------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_hf_reads_our_dict(name):
    c = PRESETS[name]()
    hf = hf_from_ours(c)
    assert tuple(hf.indexer_types) == c.indexer_types
    assert tuple(hf.mlp_layer_types) == c.mlp_layer_types
    assert hf.rope_parameters == c.rope.to_dict()
    assert eos_tuple(hf.eos_token_id) == c.eos_token_id
    for field in SCALAR_FIELDS:
        assert getattr(hf, field) == getattr(c, field), field
    assert hf.qk_head_dim == c.qk_head_dim


def test_defaults_match_hf_defaults():
    ours, hf = config.ModelConfig(), transformers.GlmMoeDsaConfig()
    # HF has no num_nextn_predict_layers field (it only passes the key through); ours defaults to 0.
    assert [f for f in SCALAR_FIELDS if not hasattr(hf, f)] == ["num_nextn_predict_layers"]
    assert ours.num_nextn_predict_layers == 0
    for field in SCALAR_FIELDS:
        if field != "num_nextn_predict_layers":
            assert getattr(hf, field) == getattr(ours, field), field
    assert tuple(hf.indexer_types) == ours.indexer_types
    assert tuple(hf.mlp_layer_types) == ours.mlp_layer_types
    assert hf.rope_parameters == ours.rope.to_dict()


@pytest.mark.parametrize("name", PRESETS)
def test_we_read_hf_dicts(name):
    c = PRESETS[name]()
    hf = hf_from_ours(c)
    # What HF's save_pretrained writes (the diff against its defaults) reads back exactly.
    assert config.ModelConfig.from_hf_dict(hf.to_diff_dict()) == c
    # The full to_dict() adds PreTrainedConfig bookkeeping keys; those land in `extra`, nothing else differs.
    full = config.ModelConfig.from_hf_dict(hf.to_dict())
    assert full.replace(extra=()) == c
    generic = set(transformers.PreTrainedConfig().to_dict())
    assert {k for k, _ in full.extra} <= generic


@pytest.mark.parametrize("name", PRESETS)
def test_files_interchange_with_hf(name, tmp_path):
    c = PRESETS[name]()
    c.save_json(tmp_path / "config.json")
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf) is transformers.GlmMoeDsaConfig
    assert tuple(hf.indexer_types) == c.indexer_types and hf.rope_parameters == c.rope.to_dict()
    out = tmp_path / "hf"
    hf.save_pretrained(out)
    assert config.ModelConfig.from_json_file(out / "config.json") == c


@pytest.mark.parametrize("layers, explicit", [
    (5, ["full", "shared", "full", "shared", "shared"]),
    (3, ["full", "full", "full"]),
])
def test_explicit_indexer_types_match_hf(layers, explicit):
    ours = config.ModelConfig.from_hf_dict(
        {"model_type": "glm_moe_dsa", "num_hidden_layers": layers, "indexer_types": explicit})
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=layers, indexer_types=list(explicit))
    assert ours.indexer_types == tuple(hf.indexer_types) == tuple(explicit)


@pytest.mark.parametrize("pattern", ["FSSF", "FFSFSS", ["full", "shared", "full"]])
def test_index_topk_pattern_matches_hf(pattern):
    n = len(pattern)
    ours = config.ModelConfig.from_hf_dict(
        {"model_type": "glm_moe_dsa", "num_hidden_layers": n, "index_topk_pattern": pattern})
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=n, index_topk_pattern=pattern)
    assert ours.indexer_types == tuple(hf.indexer_types)
    assert ours.indexer_types[0] == "full" and len(ours.indexer_types) == n


def test_pattern_string_values():
    assert config.derive_indexer_types(4, pattern="FSSF") == ("full", "shared", "shared", "full")


@pytest.mark.parametrize("layers, schedule", [
    (78, dict(index_topk_freq=4, index_skip_topk_offset=3)),
    (12, dict(index_topk_freq=2, index_skip_topk_offset=2)),
    (10, dict(index_topk_freq=1)),
    (9, dict(index_topk_freq=3, index_skip_topk_offset=1)),
    (8, dict(index_topk_freq=0, index_skip_topk_offset=5)),
    (7, dict(index_skip_topk_offset=4)),
    (6, {}),
])
def test_freq_offset_schedule_matches_hf(layers, schedule):
    ours = config.ModelConfig.from_hf_dict({"model_type": "glm_moe_dsa", "num_hidden_layers": layers, **schedule})
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=layers, **schedule)
    assert ours.indexer_types == tuple(hf.indexer_types)
    assert len(ours.indexer_types) == layers


def test_schedule_with_shared_first_layer_matches_hf_but_is_rejected():
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=0)
    derived = config.derive_indexer_types(6, freq=2, offset=0)
    assert derived == tuple(hf.indexer_types) == ("shared", "full") * 3
    with pytest.raises(ValueError, match=re.escape("ModelConfig.indexer_types: layer 0 is 'shared'")):
        config.ModelConfig.from_hf_dict(
            {"model_type": "glm_moe_dsa", "num_hidden_layers": 6, "index_topk_freq": 2, "index_skip_topk_offset": 0})


def test_expert_count_aliases():
    for alias in ("num_local_experts", "num_experts"):
        c = config.ModelConfig.from_hf_dict(hf_raw(n_routed_experts=None, **{alias: 16}))
        assert c.n_routed_experts == 16
        assert c.extra == ()


def test_null_shared_experts_means_none():
    raw = hf_raw()
    raw["n_shared_experts"] = None
    assert config.ModelConfig.from_hf_dict(raw).n_shared_experts == 0


# -- legacy rope keys ------------------------------------------------------------------------------


def test_legacy_rope_scaling_matches_rope_parameters():
    yarn = json.loads(SCALING_2M.read_text())["rope_parameters"]
    legacy_scaling = {k: v for k, v in yarn.items() if k not in ("rope_type", "rope_theta")} | {"type": "yarn"}
    base = {"model_type": "glm_moe_dsa", "max_position_embeddings": 2097168}
    legacy = config.ModelConfig.from_hf_dict(base | {"rope_theta": 8e6, "rope_scaling": legacy_scaling})
    modern = config.ModelConfig.from_hf_dict(base | {"rope_parameters": yarn})
    assert legacy.rope == modern.rope
    assert legacy.rope.rope_type == "yarn" and legacy.rope.factor == FACTOR_2M
    assert legacy.rope.rope_theta == 8e6 and legacy.rope.original_max_position_embeddings == 1048576
    assert legacy == modern
    # HF standardizes the same legacy keys into parameters that parse to the same rope.
    hf = transformers.GlmMoeDsaConfig(
        max_position_embeddings=2097168, rope_theta=8e6, rope_scaling=dict(legacy_scaling))
    parsed = positions.RopeParameters.from_dict(hf.rope_parameters, max_position_embeddings=2097168)
    assert parsed == modern.rope


def test_legacy_top_level_rope_theta_alone():
    c = config.ModelConfig.from_hf_dict({"model_type": "glm_moe_dsa", "rope_theta": 5e5})
    assert c.rope == positions.RopeParameters(rope_type="default", rope_theta=5e5)
    assert config.ModelConfig.from_hf_dict({"model_type": "glm_moe_dsa"}).rope.rope_theta == 10000.0


# -- extra and ignored keys ------------------------------------------------------------------------


def test_extra_keys_survive_and_ignored_keys_are_dropped(tmp_path):
    raw = hf_raw(ep_size=8, index_share_for_mtp_iteration=True, transformers_version="5.24.0", dtype="bfloat16",
                 torch_dtype="bfloat16", use_cache=True)
    c = config.ModelConfig.from_hf_dict(raw)
    assert c.extra == (("ep_size", 8), ("index_share_for_mtp_iteration", True))
    assert c.replace(extra=()) == config.tiny()
    out = c.to_hf_dict()
    assert out["ep_size"] == 8 and out["index_share_for_mtp_iteration"] is True
    assert not {"transformers_version", "dtype", "torch_dtype", "use_cache"} & set(out)
    assert config.ModelConfig.from_hf_dict(out) == c
    c.save_json(tmp_path / "config.json")
    assert config.ModelConfig.from_json_file(tmp_path / "config.json") == c


def test_fixed_value_keys_accept_supported_values():
    raw = hf_raw(scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True, indexer_rope_interleave=True,
                 moe_layer_freq=1)
    c = config.ModelConfig.from_hf_dict(raw)
    assert c == config.tiny().replace(extra=c.extra)
    assert dict(c.extra)["scoring_func"] == "sigmoid" and dict(c.extra)["rope_interleave"] is True


# -- errors ----------------------------------------------------------------------------------------

# (tiny() overrides, expected message start); every message names the field.
MODEL_ERRORS = [
    (dict(indexer_types=("full",) * 5), "ModelConfig.indexer_types: has 5 entries for num_hidden_layers=6"),
    (dict(indexer_types=("full", "sparse") * 3), "ModelConfig.indexer_types: unknown value(s) ['sparse']"),
    (dict(indexer_types=("shared",) + ("full",) * 5), "ModelConfig.indexer_types: layer 0 is 'shared'"),
    (dict(mlp_layer_types=("dense",) * 7), "ModelConfig.mlp_layer_types: has 7 entries for num_hidden_layers=6"),
    (dict(mlp_layer_types=("dense",) + ("moe",) * 5), "ModelConfig.mlp_layer_types: unknown value(s) ['moe']"),
    (dict(num_key_value_heads=2), "ModelConfig.num_key_value_heads: MLA needs num_key_value_heads"),
    (dict(n_group=3), "ModelConfig.n_group: n_routed_experts=8 is not divisible by n_group=3"),
    (dict(n_group=8, topk_group=1), "ModelConfig.n_group: each expert group needs at least 2 experts"),
    (dict(topk_group=3), "ModelConfig.topk_group: topk_group=3 exceeds n_group=2"),
    (dict(num_experts_per_tok=5), "ModelConfig.num_experts_per_tok: 5 experts per token but only 4 are eligible"),
    (dict(hidden_act="gelu"), "ModelConfig.hidden_act: only 'silu' is supported, got 'gelu'"),
    (dict(attention_bias=True), "ModelConfig.attention_bias: attention biases are not supported"),
    (dict(hidden_size=0), "ModelConfig.hidden_size: expected a positive integer, got 0"),
    (dict(hidden_size="64"), "ModelConfig.hidden_size: expected a positive integer, got '64'"),
    (dict(hidden_size=64.0), "ModelConfig.hidden_size: expected a positive integer, got 64.0"),
    (dict(vocab_size=True), "ModelConfig.vocab_size: expected a positive integer, got True"),
    (dict(index_topk=-1), "ModelConfig.index_topk: expected a positive integer, got -1"),
    (dict(num_hidden_layers="6"), "ModelConfig.num_hidden_layers: expected a positive integer, got '6'"),
    (dict(n_shared_experts=-1), "ModelConfig.n_shared_experts: expected a non-negative integer, got -1"),
    (dict(first_k_dense_replace="1", mlp_layer_types=()),
     "ModelConfig.first_k_dense_replace: expected a non-negative integer, got '1'"),
    (dict(qk_rope_head_dim=15), "ModelConfig.qk_rope_head_dim: must be even, got 15"),
    (dict(index_head_dim=8), "ModelConfig.index_head_dim: 8 is smaller than qk_rope_head_dim=16"),
    (dict(rms_norm_eps=0.0), "ModelConfig.rms_norm_eps: must be a number > 0, got 0.0"),
    (dict(rms_norm_eps="1e-5"), "ModelConfig.rms_norm_eps: must be a number > 0, got '1e-5'"),
    (dict(eos_token_id=(1, 512)), "ModelConfig.eos_token_id: (1, 512) has ids outside [0, vocab_size=512)"),
    (dict(eos_token_id=-1), "ModelConfig.eos_token_id: (-1,) has ids outside"),
    (dict(bos_token_id=512), "ModelConfig.bos_token_id: 512 is not a token id below vocab_size=512"),
    (dict(pad_token_id=-3), "ModelConfig.pad_token_id: -3 is not a token id"),
]


@pytest.mark.parametrize("overrides, message", MODEL_ERRORS, ids=[m.split(":")[0] for _, m in MODEL_ERRORS])
def test_model_config_errors(overrides, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        config.tiny(**overrides)


# (changes to tiny()'s config.json dict, expected message start).
HF_DICT_ERRORS = [
    (dict(model_type="deepseek_v3"), "config.model_type: expected 'glm_moe_dsa', got 'deepseek_v3'"),
    (dict(model_type=None), "config.model_type: expected 'glm_moe_dsa', got None"),
    (dict(scoring_func="softmax"), "config.scoring_func: only 'sigmoid' is supported, got 'softmax'"),
    (dict(topk_method="greedy"), "config.topk_method: only 'noaux_tc' is supported, got 'greedy'"),
    (dict(rope_interleave=False), "config.rope_interleave: only True is supported, got False"),
    (dict(indexer_rope_interleave=False), "config.indexer_rope_interleave: only True is supported, got False"),
    (dict(moe_layer_freq=2), "config.moe_layer_freq: only 1 is supported, got 2"),
    (dict(hidden_act="gelu"), "config.hidden_act: only 'silu' is supported, got 'gelu'"),
    (dict(attention_bias=True), "ModelConfig.attention_bias"),
    (dict(hidden_size=0), "ModelConfig.hidden_size: expected a positive integer, got 0"),
    (dict(hidden_size="64"), "ModelConfig.hidden_size: expected a positive integer, got '64'"),
    (dict(indexer_types=["full"] * 7), "ModelConfig.indexer_types: has 7 entries for num_hidden_layers=6"),
    (dict(indexer_types=None, index_topk_pattern="FSXFSF"),
     "config.index_topk_pattern: characters ['X'] are not 'F' or 'S'"),
    (dict(indexer_types=None, index_topk_pattern="FSS"), "ModelConfig.indexer_types: has 3 entries"),
    (dict(indexer_types=None, index_topk_freq="4"), "config.index_topk_freq: expected an integer, got '4'"),
    (dict(indexer_types=None, index_skip_topk_offset=1.5),
     "config.index_skip_topk_offset: expected an integer, got 1.5"),
    (dict(indexer_types=None, num_hidden_layers="6"), "config.num_hidden_layers: expected an integer, got '6'"),
    (dict(eos_token_id=[1, 600]), "ModelConfig.eos_token_id: (1, 600) has ids outside"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "config.rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}), "config.rope_parameters.rope_theta"),
]


@pytest.mark.parametrize("changes, message", HF_DICT_ERRORS, ids=[m.split(":")[0] for _, m in HF_DICT_ERRORS])
def test_hf_dict_errors(changes, message):
    raw = hf_raw(**changes)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        config.ModelConfig.from_hf_dict(raw)


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(ValueError, match=re.escape(f"config file {str(path)!r} does not exist")):
        config.ModelConfig.from_json_file(path)


def test_invalid_json_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "glm_moe_dsa",')
    with pytest.raises(ValueError, match=re.escape(f"config file {str(path)!r} is not valid JSON")):
        config.ModelConfig.from_json_file(path)


def test_config_file_errors_are_reported_from_content(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_raw(n_group=3)))
    with pytest.raises(ValueError, match=re.escape("ModelConfig.n_group: n_routed_experts=8")):
        config.ModelConfig.from_json_file(path)


# -- position extension from the environment ------------------------------------------------------


def test_env_rope_scaling_unset_returns_same_config(monkeypatch):
    monkeypatch.delenv(positions.ROPE_SCALING_ENV, raising=False)
    c = config.glm52()
    assert c.with_env_rope_scaling() is c
    monkeypatch.setenv(positions.ROPE_SCALING_ENV, "")
    assert c.with_env_rope_scaling() is c


def test_env_rope_scaling_2m(monkeypatch):
    monkeypatch.setenv(positions.ROPE_SCALING_ENV, str(SCALING_2M))
    base = config.glm52()
    c = base.with_env_rope_scaling()
    assert c.max_position_embeddings == 2097168
    assert c.rope.rope_type == "yarn"
    assert c.rope.factor == FACTOR_2M == 2097168 / 1048576
    assert c.rope.original_max_position_embeddings == 1048576 and c.rope.rope_theta == 8e6
    assert c.replace(max_position_embeddings=base.max_position_embeddings, rope=base.rope) == base
    expected = 256 ** -0.5 * (0.1 * math.log(FACTOR_2M) + 1.0) ** 2
    assert c.softmax_scale == pytest.approx(expected, rel=1e-15)
    assert c.softmax_scale > base.softmax_scale
    # The extended config survives a config.json round trip.
    assert config.ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_env_rope_scaling_rejects_other_theta(monkeypatch, tmp_path):
    payload = json.loads(SCALING_2M.read_text())
    payload["rope_parameters"]["rope_theta"] = 10000.0
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps(payload))
    monkeypatch.setenv(positions.ROPE_SCALING_ENV, str(path))
    with pytest.raises(ValueError, match=re.escape("rope scaling rope_theta=10000.0 differs from the model's "
                                                   "rope_theta=8000000.0")):
        config.glm52().with_env_rope_scaling()
    assert config.tiny().with_env_rope_scaling().rope.rope_type == "yarn"  # tiny has theta 1e4
