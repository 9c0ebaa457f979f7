"""The typed run spec: every shipped config builds, every bad value is refused naming its flag."""

import json
import subprocess
import sys

import pytest

from glm52_jax import choices, run_defaults
from glm52_jax.run_config import (
    ConfigError,
    RunSpec,
    check_rerun,
    differences,
    flatten,
    load_saved_spec,
    save_spec,
)
from tests.run_helpers import config_spec, load_config


@pytest.mark.parametrize("name", ["tiny", "2m", "2m_one_node", "32k_parity", "32k_parity_one_node"])
def test_shipped_configs_build_and_round_trip(name):
    spec = config_spec(name)
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.config_sha256() == spec.config_sha256()
    # Every config has exactly the defaults' keys (they are overrides of run_defaults.get_config()).
    assert flatten(load_config(name).to_dict()).keys() == flatten(run_defaults.get_config().to_dict()).keys()


def test_configs_override_only_what_they_change():
    base, m2, parity = (flatten(config_spec(n).to_dict()) for n in ("tiny", "2m", "32k_parity"))
    changed_2m = sorted(k for k in base if base[k] != m2[k])
    assert changed_2m == ["data.dedupe", "data.prompt_tokens", "mesh", "model.checkpoint", "model.dtype",
                          "model.expert_dtype", "model.gather_weights_min_tokens", "model.indexer_candidates",
                          "model.indexer_dtype", "model.moe_exchange_windows", "model.moe_node_devices",
                          "model.moe_receive_capacity", "model.moe_token_block", "model.moe_transport", "model.preset",
                          "model.rope_scaling_json", "name", "plan.target",
                          "sampling.chunk_size",
                          "sampling.max_new_tokens", "sampling.prefill_mode", "sampling.prefix_cache_mib_per_device",
                          "sampling.samples_per_request", "search.probe_tokens", "train.learning_rate"], changed_2m
    assert (m2["sampling.samples_per_request"], m2["sampling.num_samples"]) == (8, 2)  # the seed's 8 per request, G=2
    # The seed's runs plan for the H20 with XLA's GPU compiler (both share glm52_release); tiny runs plan on CPU.
    assert (base["plan.target"], m2["plan.target"], parity["plan.target"]) == ("cpu", "h20", "h20")
    assert (base["sampling.samples_per_request"], base["model.init_adapter"]) == (0, "")
    # Parity keeps the one-stage MoE exchange of 256-token rounds in 2 windows (its plan was made so) and bf16 experts.
    assert sorted(k for k in m2 if m2[k] != parity[k]) == ["data.prompt_tokens", "model.expert_dtype",
                                                          "model.indexer_candidates",
                                                          "model.indexer_dtype", "model.moe_exchange_windows",
                                                          "model.moe_node_devices", "model.moe_token_block",
                                                          "model.rope_scaling_json", "name",
                                                          "parity.acceptance", "sampling.chunk_size",
                                                          "sampling.prefill_mode",
                                                          "sampling.prefix_cache_mib_per_device",
                                                          "sampling.samples_per_request", "search.probe_tokens"]


def test_one_node_config_is_the_2m_run_on_eight_h200():
    """configs/2m_one_node.py: configs/2m.py's transaction (YaRN payload, 8 samples per request with G = 2, the
    shared prompt cache, the probe, the whole-prompt prefill) on one 8-GPU node: folded=8, FP8 base weights and
    cache, one synchronous EP exchange per pass (NVLink), planned for the H200."""
    m2, one = (flatten(config_spec(n).to_dict()) for n in ("2m", "2m_one_node"))
    assert sorted(k for k in m2 if m2[k] != one[k]) == ["mesh", "model.base_weights", "model.cache_dtype",
                                                       "model.expert_dtype", "model.indexer_candidates",
                                                       "model.indexer_dtype",
                                                       "model.moe_node_devices", "model.moe_token_block", "name",
                                                       "plan.target"]
    assert (one["model.indexer_dtype"], one["model.indexer_candidates"]) == ("bf16", 0)  # as its plan was made
    assert (m2["model.expert_dtype"], one["model.expert_dtype"]) == ("fp8", "bf16")
    assert (m2["model.moe_exchange_windows"], one["model.moe_exchange_windows"]) == (1, 1)
    assert (m2["model.moe_node_devices"], one["model.moe_node_devices"]) == (8, 0)  # 4 hosts x 8 / one node
    assert one["sampling.prefill_mode"] == "whole"
    assert (one["mesh"], one["model.base_weights"], one["model.cache_dtype"], one["plan.target"]) == (
        "folded=8", "fp8", "float8_e4m3fn", "h200")
    assert config_spec("2m_one_node").mesh_spec().describe() == "DP1/TP1/CP8/EP8/PP1"
    assert (m2["model.base_weights"], config_spec("tiny").model.base_weights) == ("stored", "stored")


def test_one_node_parity_config_is_the_32k_parity_on_the_one_node_mesh():
    """configs/32k_parity_one_node.py: configs/32k_parity.py's comparison on configs/2m_one_node.py's mesh, base
    weights and plan target; the cache keeps the parameter dtype, so the acceptance bounds stand."""
    parity, one = (flatten(config_spec(n).to_dict()) for n in ("32k_parity", "32k_parity_one_node"))
    node = flatten(config_spec("2m_one_node").to_dict())
    assert sorted(k for k in parity if parity[k] != one[k]) == ["mesh", "model.base_weights", "name", "plan.target"]
    assert all(one[k] == node[k] for k in ("mesh", "model.base_weights", "plan.target"))
    assert one["model.cache_dtype"] == parity["model.cache_dtype"] == "auto"


def test_weight_sharding_reaches_the_mesh_rules():
    """model.weight_sharding picks the mesh's rules: "fsdp" (default, the 2M run's) maps the FSDP name to every mesh
    axis; "replicated" leaves it out."""
    from glm52_jax.parallel.rules import FSDP

    fsdp, replicated = (config_spec("2m", **{"model.weight_sharding": w}).mesh_spec() for w in ("fsdp", "replicated"))
    assert config_spec("2m").model.weight_sharding == "fsdp"
    assert dict(fsdp.rules())[FSDP] == ("data", "cp_ep", "tensor") and FSDP not in dict(replicated.rules())
    assert fsdp.describe() == replicated.describe() == "DP1/TP1/CP32/EP32/PP1"


def test_the_spec_and_the_launcher_start_without_jax():
    code = ("import sys; import glm52_jax.run_config, glm52_jax.run_defaults, glm52_jax.workdir, glm52_jax.launch; "
            "from tests.run_helpers import config_spec; config_spec('2m').mesh_spec(); "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("key,value,message", [
    ("train.max_grad_norm", 0.0, "--config.train.max_grad_norm=0.0: must be > 0"),
    ("train.max_grad_norm", -1.0, "--config.train.max_grad_norm=-1.0: must be > 0"),
    ("train.learning_rate", -1.0, "--config.train.learning_rate=-1.0: must be > 0"),
    ("train.learning_rate", float("nan"), "--config.train.learning_rate=nan: must be > 0"),
    ("train.weight_decay", -0.1, "--config.train.weight_decay=-0.1: must be >= 0"),
    ("train.clip_ratio_low", 1.0, "--config.train.clip_ratio_low=1.0: must be > 0 and < 1"),
    ("train.clip_ratio_high", 0.0, "--config.train.clip_ratio_high=0.0: must be > 0 and < 1"),
    ("train.loss_agg_mode", "mean", "--config.train.loss_agg_mode=mean: must be one of token-mean, "
                                    "seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"),
    ("train.gradient_mode", "fast", "--config.train.gradient_mode=fast: must be one of conventional, "
                                    "response_only, shared_prefix"),
    ("train.steps", 0, "--config.train.steps=0: must be >= 1 (transactions in the run)"),
    ("sampling.top_p", 0.0, "--config.sampling.top_p=0.0: must be > 0 and <= 1"),
    ("sampling.top_p", 1.5, "--config.sampling.top_p=1.5: must be > 0 and <= 1"),
    ("sampling.temperature", 0.0, "--config.sampling.temperature=0.0: must be > 0"),
    ("sampling.max_new_tokens", 0, "--config.sampling.max_new_tokens=0: must be >= 1"),
    ("sampling.num_samples", 1, "--config.sampling.num_samples=1: must be >= 2 (GRPO compares samples)"),
    ("sampling.top_k", -1, "--config.sampling.top_k=-1: must be >= 0 (0 = no top-k truncation)"),
    ("sampling.prefill_mode", "all", "--config.sampling.prefill_mode=all: must be one of chunked, whole"),
    ("search.max_candidates", 0, "--config.search.max_candidates=0: must be >= 1"),
    ("search.probe_tokens", -1, "--config.search.probe_tokens=-1: must be >= 0 (0 = no engine probe)"),
    ("search.probe_tokens", 256, "--config.search.probe_tokens=256: must be 0 (off) or shorter than "
                                 "--config.data.prompt_tokens=256"),
    ("model.lora_families", ("attention", "lm_head"), "--config.model.lora_families=('attention', 'lm_head'): "
                                                      "unknown ['lm_head']; choose from attention, routed_experts, "
                                                      "shared_expert, dense_mlp, unembed"),
    ("model.lora_families", ("attention", "attention"), "lists an entry twice"),
    ("model.lora_rank", 0, "--config.model.lora_rank=0: must be >= 1"),
    ("model.dtype", "float16", "--config.model.dtype=float16: must be one of float32, bfloat16"),
    ("model.base_weights", "int8", "--config.model.base_weights=int8: must be one of stored, fp8"),
    ("model.kernels", "cuda", "--config.model.kernels=cuda: must be one of auto, reference, pallas"),
    ("model.moe_transport", "nccl", "--config.model.moe_transport=nccl: must be one of auto, dense, ragged"),
    ("model.moe_token_block", 0, "--config.model.moe_token_block=0: must be >= 1"),
    ("model.moe_receive_capacity", 0.5, "--config.model.moe_receive_capacity=0.5: must be 0 (the worst case) or >= 1"),
    ("model.moe_exchange_windows", 0, "--config.model.moe_exchange_windows=0: must be >= 1"),
    ("model.moe_node_devices", -1, "--config.model.moe_node_devices=-1: must be >= 0 (0 = one exchange over the "
                                   "expert axis)"),
    ("model.gather_weights_min_tokens", -1, "--config.model.gather_weights_min_tokens=-1: must be >= 0"),
    ("model.cache_dtype", "float8", "--config.model.cache_dtype=float8: must be one of auto, float8_e4m3fn"),
    ("model.indexer_dtype", "e4m3", "--config.model.indexer_dtype=e4m3: must be one of bf16, fp8"),
    ("model.indexer_candidates", -1, "--config.model.indexer_candidates=-1: must be >= 0"),
    ("parity.reference", "shared", "--config.parity.reference=shared: must be one of conventional"),
    ("parity.lora_b_std", 0.0, "--config.parity.lora_b_std=0.0: must be > 0"),
    ("parity.outliers", 0, "--config.parity.outliers=0: must be >= 1"),
    ("parity.acceptance", ("shared_prefix: rel_l2 <= 1e-5",), "no acceptance bounds for response_only (add "
                                                             "'response_only: cosine >= ..., rel_l2 <= ...')"),
    ("parity.acceptance", ("shared: rel_l2 <= 1e-5",), "entry 'shared: rel_l2 <= 1e-5' must start with 'MODE:'"),
    ("parity.acceptance", ("shared_prefix: rel_l2 >= 1e-5",), "'rel_l2 >= 1e-5': rel_l2 takes <="),
    ("parity.acceptance", ("shared_prefix: l2 <= 1",), "unknown metric 'l2'; choose from cosine, rel_l2"),
    ("parity.acceptance", ("shared_prefix: lm_head.rel_l2 <= 1",), "a family prefix must be one of attention"),
    ("parity.acceptance", ("shared_prefix: rel_l2 <= x",), "'x' is not a number"),
    ("parity.acceptance", ("shared_prefix: rel_l2 <= 1, rel_l2 <= 2",), "rel_l2 <= 2 is bounded twice"),
    ("parity.acceptance", ("shared_prefix: rel_l2 <= 1", "shared_prefix: cosine >= 1"), "has two entries"),
    ("plan.programs", ("prefill", "sample"), "unknown ['sample']"),
    ("plan.hbm_gib", 0.0, "--config.plan.hbm_gib=0.0: must be > 0"),
    ("plan.target", "h100", "--config.plan.target=h100: must be one of cpu, h20, h200"),
    ("data.prompt_tokens", 1, "--config.data.prompt_tokens=1: must be >= 2"),
    ("mesh", "context=four", "--config.mesh=context=four: mesh 'context=four': expected name=integer items"),
    ("name", "my run", "--config.name=my run: must be a non-empty name"),
    ("train.steps", 1.5, "--config.train.steps=1.5: must be an integer"),
    ("data.dedupe", 1, "--config.data.dedupe=1: must be True or False"),
    ("sampling.samples_per_request", 1, "--config.sampling.samples_per_request=1: must be 0 (= num_samples) or >= "
                                        "--config.sampling.num_samples=2 (the group is chosen from the request's "
                                        "samples)"),
    ("sampling.samples_per_request", -1, "--config.sampling.samples_per_request=-1: must be >= 0 (0 = num_samples)"),
    ("model.init_adapter", 3, "--config.model.init_adapter=3: must be a string"),
    ("model.weight_sharding", "zero3", "--config.model.weight_sharding=zero3: must be one of fsdp, replicated"),
    ("reward.boxed_fallback", "yes", "--config.reward.boxed_fallback=yes: must be True or False"),
    ("checkpoint.keep", 0, "--config.checkpoint.keep=0: must be >= 1 (the newest step checkpoint is what a rerun "
                           "resumes from)"),
    ("checkpoint.keep", 2.0, "--config.checkpoint.keep=2.0: must be an integer"),
    ("watchdog.phase_timeout_s", -1, "--config.watchdog.phase_timeout_s=-1.0: must be >= 0"),
    ("watchdog.plan_factor", 0.5, "--config.watchdog.plan_factor=0.5: must be 0 (no plan) or >= 1"),
])
def test_bad_values_name_their_flag(key, value, message):
    with pytest.raises(ConfigError) as info:
        config_spec("tiny", **{key: value})
    assert str(info.value).startswith(message) or message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides,message", [
    ({"mesh": "folded=8", "model.moe_node_devices": 3},
     "--config.model.moe_node_devices=3: must divide the expert axis (8 devices in --config.mesh='folded=8') or be "
     "at least its size (one node); 0 = one exchange"),
    ({"mesh": "folded=8", "model.moe_node_devices": 4, "model.moe_transport": "ragged"},
     "--config.model.moe_node_devices=4: needs --config.model.moe_transport=dense, not 'ragged'"),
])
def test_node_devices_against_the_mesh_and_transport(overrides, message):
    """The two-stage MoE exchange's node size fits the expert axis and its transport, checked with the config."""
    with pytest.raises(ConfigError) as info:
        config_spec("tiny", **{"model.moe_transport": "dense", **overrides})
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
    # A node at least the axis (a one-device override of a multi-host config) is one stage, not an error.
    assert config_spec("2m", mesh="context=2,expert=2").model.moe_node_devices == 8


def test_reward_and_checkpoint_keys():
    """reward.boxed_fallback (off: the seed's rule) is part of the run: a resume must share it; checkpoint.keep
    (3) may change on a rerun, as it does not change what a step computes."""
    spec = config_spec("tiny")
    assert (spec.reward.boxed_fallback, spec.checkpoint.keep) == (False, 3)
    assert (config_spec("2m").reward.boxed_fallback, config_spec("2m").checkpoint.keep) == (False, 3)
    fallback = spec.replace(**{"reward.boxed_fallback": True})
    assert fallback.reward.boxed_fallback is True and fallback.resume_sha256() != spec.resume_sha256()
    keep = spec.replace(**{"checkpoint.keep": 1})
    assert keep.checkpoint.keep == 1 and keep.resume_sha256() == spec.resume_sha256() != keep.config_sha256()
    check_rerun(spec, keep, "/tmp/run")
    with pytest.raises(ConfigError, match=r"reward\.boxed_fallback: saved False, now True"):
        check_rerun(spec, fallback, "/tmp/run")


def test_watchdog_keys_may_change_and_older_saved_configs_load(tmp_path):
    """The hang watchdog's deadlines are not the run: a rerun may change them, the resume hash ignores them, and a
    config.json saved before the section existed loads with its defaults (the same run, resumable)."""
    spec = config_spec("tiny")
    assert (spec.watchdog.phase_timeout_s, spec.watchdog.plan_factor) == (3600.0, 3.0)
    shorter = spec.replace(**{"watchdog.phase_timeout_s": 5.0, "watchdog.plan_factor": 0.0})
    assert shorter.resume_sha256() == spec.resume_sha256() != shorter.config_sha256()
    check_rerun(spec, shorter, tmp_path)
    path = save_spec(spec, tmp_path, ["python", "-m", "glm52_jax.launch"])
    record = json.loads(path.read_text())
    del record["config"]["watchdog"]
    path.write_text(json.dumps(record))
    assert load_saved_spec(tmp_path) == spec


def test_unknown_and_missing_keys():
    values = config_spec("tiny").to_dict()
    values["train"]["stpes"] = values["train"].pop("steps")
    with pytest.raises(ConfigError, match=r"^unknown config key train\.stpes \(did you mean train\.steps\?\)$"):
        RunSpec.from_dict(values)
    values = config_spec("tiny").to_dict()
    del values["sampling"]["top_k"]
    with pytest.raises(ConfigError, match=r"config lacks key\(s\) sampling\.top_k"):
        RunSpec.from_dict(values)


def test_hashes_and_rerun_rules(tmp_path):
    spec = config_spec("tiny")
    longer = spec.replace(**{"train.steps": 5, "plan.hbm_gib": 141.0})
    assert longer.config_sha256() != spec.config_sha256() and longer.resume_sha256() == spec.resume_sha256()
    check_rerun(spec, longer, tmp_path)  # steps and plan settings may change
    # The initial adapter and the samples per request are part of the run: a resume must share them.
    for key, value in (("model.init_adapter", "/adapters/a"), ("sampling.samples_per_request", 8)):
        assert spec.replace(**{key: value}).resume_sha256() != spec.resume_sha256(), key
    other = spec.replace(**{"train.learning_rate": 0.5, "sampling.num_samples": 4})
    assert differences(spec, other) == [("sampling.num_samples", 2, 4), ("train.learning_rate", 0.0001, 0.5)]
    with pytest.raises(ConfigError, match=r"sampling\.num_samples: saved 2, now 4; train\.learning_rate: saved "
                                          r"0\.0001, now 0\.5\)"):
        check_rerun(spec, other, tmp_path)


def test_saved_spec_round_trip_and_corruption(tmp_path):
    spec = config_spec("2m")
    path = save_spec(spec, tmp_path, ["python", "-m", "glm52_jax.launch", "--config=configs/2m.py"])
    record = json.loads(path.read_text())
    assert record["command"][-1] == "--config=configs/2m.py" and record["config_sha256"] == spec.config_sha256()
    assert load_saved_spec(tmp_path) == spec and load_saved_spec(tmp_path / "none") is None
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not a saved run config"):
        load_saved_spec(tmp_path)


def test_choices_are_the_ones_the_code_implements():
    from glm52_jax import config
    from glm52_jax.model.lora import FAMILIES
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.rl import grpo
    from glm52_jax.rl.gradients import MODES
    from glm52_jax.rollout.sampler import PREFILL_MODES

    assert tuple(config.PRESETS) == choices.PRESETS
    assert (MODES, PREFILL_MODES, grpo.LOSS_AGG_MODES, FAMILIES) == (
        choices.GRADIENT_MODES, choices.PREFILL_MODES, choices.LOSS_AGG_MODES, choices.LORA_FAMILIES)
    for kernels in choices.KERNELS:
        ModelOptions(kernels=kernels)
    for transport in choices.MOE_TRANSPORTS:
        ModelOptions(moe_transport=transport)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="gather_weights_min_tokens: expected an integer >= 0"):
            ModelOptions(gather_weights_min_tokens=bad)
    for cache_dtype in choices.CACHE_DTYPES:
        ModelOptions(cache_dtype=cache_dtype)
    with pytest.raises(ValueError, match=r"cache_dtype: expected one of \('auto', 'float8_e4m3fn'\), got 'bfloat16'"):
        ModelOptions(cache_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"indexer_dtype: expected one of \('bf16', 'fp8'\), got 'float8'"):
        ModelOptions(indexer_dtype="float8")
    assert ModelOptions(latent_norm_eps=1e-5).latent_norm_eps == 1e-5 and ModelOptions().latent_norm_eps is None
    for bad in (0, -1e-6, 1.0, True, "1e-5"):
        with pytest.raises(ValueError, match="latent_norm_eps: expected None or a number in .0, 1."):
            ModelOptions(latent_norm_eps=bad)


def test_settings_build_the_objects_the_spec_configures():
    from glm52_jax.rl import settings

    spec = config_spec("tiny", **{"train.max_grad_norm": 0.5, "model.lora_families": ("attention", "unembed"),
                                  "model.kernels": "reference", "model.moe_transport": "ragged",
                                  "model.moe_token_block": 256, "model.moe_receive_capacity": 1.5,
                                  "model.gather_weights_min_tokens": 64, "model.cache_dtype": "float8_e4m3fn",
                                  "model.indexer_dtype": "fp8", "model.indexer_candidates": 64,
                                  "model.moe_exchange_windows": 1})
    lora = settings.lora_config(spec.model)
    assert (lora.rank, lora.alpha, lora.families) == (8, 16.0, frozenset({"attention", "unembed"}))
    options = settings.model_options(spec.model)
    assert (str(options.param_dtype), options.kernels, options.moe_transport, options.moe_token_block,
            options.moe_receive_capacity) == ("float32", "reference", "ragged", 256, 1.5)
    assert options.gather_weights_min_tokens == 64 and options.cache_dtype == "float8_e4m3fn"
    assert options.indexer_dtype == "fp8" and options.indexer_candidates == 64 and options.moe_exchange_windows == 1
    nodes = config_spec("tiny", **{"mesh": "folded=8", "model.moe_transport": "dense", "model.moe_node_devices": 4})
    assert settings.model_options(nodes.model).moe_node_devices == 4 and options.moe_node_devices == 0
    two_m = settings.model_options(config_spec("2m").model)
    assert (two_m.indexer_dtype, two_m.indexer_candidates) == ("fp8", 4096)  # bf16's top-2048 from FP8 scoring
    assert settings.model_options(config_spec("2m").model).moe_exchange_windows == 1
    assert settings.model_options(config_spec("tiny").model).cache_dtype == "auto"
    assert settings.model_options(config_spec("tiny").model).indexer_dtype == "bf16"
    assert settings.model_options(config_spec("tiny").model).indexer_candidates == 0
    assert settings.model_options(config_spec("2m").model).gather_weights_min_tokens == 512
    adamw = settings.adamw(spec.train)
    assert (adamw.learning_rate, adamw.max_grad_norm, adamw.weight_decay) == (1e-4, 0.5, 0.0)
    loss = settings.loss_settings(spec.train)
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.loss_agg_mode) == (0.2, 0.28, "token-mean")
    params = settings.sampling_params(spec.sampling, (1, 4), seed=7)
    assert (params.num_samples, params.max_new_tokens, params.seed, params.stop_token_ids) == (2, 32, 7, (1, 4))
    # A request draws samples_per_request samples when set (the group of num_samples is chosen from them).
    wide = config_spec("tiny", **{"sampling.samples_per_request": 5}).sampling
    assert (settings.sampling_params(wide, (1,), seed=7).num_samples, wide.num_samples, wide.per_request) == (5, 2, 5)
