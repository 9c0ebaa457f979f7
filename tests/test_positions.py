"""Rotary positions: the 2M YaRN payload, parity with HF's RoPE/YaRN math, angle accuracy, errors."""

import copy
import json
import math
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

from glm52_jax import config, positions

REPO = Path(__file__).resolve().parents[1]
SCALING_2M = REPO / "configs" / "glm52_2m_yarn.json"
SEED_PAYLOAD = {
    "max_position_embeddings": 2097168,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 8000000.0,
        "factor": 2.0000152587890625,
        "original_max_position_embeddings": 1048576,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "truncate": True,
    },
}
# DeepSeek-V3's published YaRN settings.
DSV3_MAX = 163840
DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
ANGLE_REPORT = Path("/tmp/angle_report.txt")
ANGLE_COMMAND = ("XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu "
                 ".venv/bin/python -m pytest -q -s tests/test_positions.py -k angle")


# -- helpers -------------------------------------------------------------------------------------


def seed_payload():
    return copy.deepcopy(SEED_PAYLOAD)


def seed_rope():
    return positions.parse_rope_scaling(SEED_PAYLOAD).rope


def yarn(max_pos, **params):
    """Our RopeParameters for a yarn dict (no checks skipped)."""
    return positions.RopeParameters.from_dict({"rope_type": "yarn", **params}, max_position_embeddings=max_pos)


def hf_config(dim, max_pos, rope_dict):
    return transformers.GlmMoeDsaConfig(qk_rope_head_dim=dim, max_position_embeddings=max_pos,
                                        rope_parameters=dict(rope_dict))


def hf_yarn(dim, max_pos, rope_dict):
    """HF's (inv_freq as float64 numpy, attention_factor) for a yarn rope."""
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(dim, max_pos, rope_dict))
    return inv.double().numpy(), factor


def hf_default_inv_freq(dim, theta):
    cfg = hf_config(dim, 4096, {"rope_type": "default", "rope_theta": theta})
    inv, factor = hf_glm.GlmMoeDsaRotaryEmbedding.compute_default_rope_parameters(cfg)
    assert factor == 1.0
    return inv.double().numpy()


def wrap(angle):
    """Maps radians to [-pi, pi)."""
    return (angle + math.pi) % (2 * math.pi) - math.pi


def exact_angles(pos, rope, dim=64):
    """Float64 reference `pos * inv_freq`, unwrapped."""
    return np.asarray(pos, np.float64)[..., None] * positions.inv_freq(rope, dim)


def write_payload(tmp_path, payload, name="scaling.json"):
    path = tmp_path / name
    path.write_text(json.dumps(payload))
    return path


# -- the 2M payload ------------------------------------------------------------------------------


def test_seed_payload_file_is_exact():
    raw = json.loads(SCALING_2M.read_text())
    assert raw == SEED_PAYLOAD
    rope = raw["rope_parameters"]
    assert raw["max_position_embeddings"] == 2097168
    assert rope["rope_type"] == "yarn"
    assert rope["rope_theta"] == 8000000.0
    assert rope["factor"] == 2.0000152587890625 == 2097168 / 1048576
    assert rope["original_max_position_embeddings"] == 1048576
    assert (rope["beta_fast"], rope["beta_slow"]) == (32.0, 1.0)
    assert (rope["mscale"], rope["mscale_all_dim"]) == (1.0, 1.0)
    assert rope["truncate"] is True


def test_seed_payload_parses():
    scaling = positions.load_rope_scaling(SCALING_2M)
    assert scaling.max_position_embeddings == 2097168
    assert scaling.rope == positions.RopeParameters(
        rope_type="yarn", rope_theta=8e6, factor=2.0000152587890625, original_max_position_embeddings=1048576,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, attention_factor=None, truncate=True)
    assert scaling.rope.to_dict() == SEED_PAYLOAD["rope_parameters"]
    assert positions.load_rope_scaling(str(SCALING_2M)) == scaling


def test_rope_dict_round_trip():
    cases = ((seed_rope(), 2097168), (yarn(DSV3_MAX, **DSV3_YARN), DSV3_MAX),
             (positions.RopeParameters(rope_theta=8e6), 4096))
    for rope, max_pos in cases:
        assert positions.RopeParameters.from_dict(rope.to_dict(), max_position_embeddings=max_pos) == rope


def test_yarn_defaults_follow_hf():
    # No original -> original = max (HF's standardize_rope_params); the factor is then taken as given.
    rope = yarn(8192, rope_theta=1e4, factor=4.0)
    assert rope.original_max_position_embeddings == 8192 and rope.factor == 4.0
    # No factor -> max / original.
    assert yarn(32768, rope_theta=1e4, original_max_position_embeddings=4096).factor == 8.0
    # Legacy "type" key.
    assert yarn(DSV3_MAX, **DSV3_YARN) == positions.RopeParameters.from_dict(
        {**{k: v for k, v in DSV3_YARN.items() if k != "rope_type"}, "type": "yarn"}, max_position_embeddings=DSV3_MAX)
    np.testing.assert_allclose(positions.inv_freq(rope, 64), hf_yarn(64, 8192, rope.to_dict())[0], rtol=1e-6)


# -- frequencies and scales vs HF --------------------------------------------------------------------


@pytest.mark.parametrize("theta", [1e4, 8e6])
@pytest.mark.parametrize("dim", [64, 16])
def test_default_inv_freq_matches_hf(theta, dim):
    ours = positions.inv_freq(positions.RopeParameters(rope_theta=theta), dim)
    assert ours.dtype == np.float64 and ours.shape == (dim // 2,)
    assert ours[0] == 1.0
    np.testing.assert_allclose(ours, hf_default_inv_freq(dim, theta), rtol=1e-6)


YARN_CASES = {
    "2m_payload": (2097168, SEED_PAYLOAD["rope_parameters"]),
    "dsv3_truncate": (DSV3_MAX, {**DSV3_YARN, "truncate": True}),
    "dsv3_no_truncate": (DSV3_MAX, {**DSV3_YARN, "truncate": False}),
    # Both correction dims clamp to 0: exercises HF's `low == high` singularity guard.
    "degenerate_ramp": (16, {"rope_type": "yarn", "rope_theta": 8e6, "factor": 4.0,
                             "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0}),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_inv_freq_matches_hf(case):
    max_pos, params = YARN_CASES[case]
    rope = yarn(max_pos, **params)
    hf_inv, _ = hf_yarn(64, max_pos, params)
    ours = positions.inv_freq(rope, 64)
    np.testing.assert_allclose(ours, hf_inv, rtol=1e-6)
    default = positions.inv_freq(positions.RopeParameters(rope_theta=params["rope_theta"]), 64)
    # High frequencies are kept, low ones divided by the factor.
    assert ours[0] == default[0]
    assert ours[-1] == pytest.approx(default[-1] / params["factor"], rel=1e-12)


def test_truncate_changes_the_ramp():
    a = positions.inv_freq(yarn(DSV3_MAX, **DSV3_YARN, truncate=True), 64)
    b = positions.inv_freq(yarn(DSV3_MAX, **DSV3_YARN, truncate=False), 64)
    assert np.max(np.abs(a - b) / a) > 1e-3


def test_inv_freq_rejects_odd_dim():
    with pytest.raises(ValueError, match="rotary dim must be even, got 63"):
        positions.inv_freq(seed_rope(), 63)


ATTENTION_FACTOR_CASES = {
    "2m_payload": (2097168, SEED_PAYLOAD["rope_parameters"]),
    "dsv3": (DSV3_MAX, DSV3_YARN),
    "mscale_differs": (DSV3_MAX, {**DSV3_YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "no_mscale": (DSV3_MAX, {k: v for k, v in DSV3_YARN.items() if not k.startswith("mscale")}),
    "explicit": (DSV3_MAX, {**DSV3_YARN, "attention_factor": 1.25}),
}


@pytest.mark.parametrize("case", ATTENTION_FACTOR_CASES)
def test_attention_factor_matches_hf(case):
    max_pos, params = ATTENTION_FACTOR_CASES[case]
    ours = positions.attention_factor(yarn(max_pos, **params))
    assert ours == pytest.approx(hf_yarn(64, max_pos, params)[1], rel=1e-12)


def test_attention_factor_values():
    assert positions.attention_factor(positions.RopeParameters(rope_theta=8e6)) == 1.0
    assert positions.attention_factor(seed_rope()) == 1.0
    assert positions.attention_factor(yarn(DSV3_MAX, **{**DSV3_YARN, "mscale": 0.707})) == pytest.approx(
        (0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1), rel=1e-12)
    no_mscale = {k: v for k, v in DSV3_YARN.items() if not k.startswith("mscale")}
    assert positions.attention_factor(yarn(DSV3_MAX, **no_mscale)) == pytest.approx(0.1 * math.log(40) + 1)
    assert positions.attention_factor(yarn(DSV3_MAX, **DSV3_YARN, attention_factor=1.25)) == 1.25


SOFTMAX_CASES = {
    "default": (4096, {"rope_type": "default", "rope_theta": 8e6}),
    "2m_payload": (2097168, SEED_PAYLOAD["rope_parameters"]),
    "dsv3": (DSV3_MAX, DSV3_YARN),
    "mscale_all_dim_0.707": (DSV3_MAX, {**DSV3_YARN, "mscale_all_dim": 0.707}),
    "no_mscale_all_dim": (DSV3_MAX, {k: v for k, v in DSV3_YARN.items() if k != "mscale_all_dim"}),
}


@pytest.mark.parametrize("case", SOFTMAX_CASES)
@pytest.mark.parametrize("qk_head_dim", [256, 192])
def test_softmax_scale_matches_hf(case, qk_head_dim):
    max_pos, params = SOFTMAX_CASES[case]
    rope = positions.RopeParameters.from_dict(params, max_position_embeddings=max_pos)
    expected = hf_glm.yarn_apply_mscale(rope.to_dict(), qk_head_dim ** -0.5)
    assert positions.softmax_scale(rope, qk_head_dim) == pytest.approx(expected, rel=1e-14)


def test_softmax_scale_values():
    assert positions.softmax_scale(seed_rope(), 256) == pytest.approx(
        256 ** -0.5 * (0.1 * math.log(2.0000152587890625) + 1) ** 2, rel=1e-15)
    assert positions.softmax_scale(yarn(DSV3_MAX, **DSV3_YARN), 192) == pytest.approx(
        192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    assert positions.softmax_scale(positions.RopeParameters(rope_theta=8e6), 256) == 1 / 16


# -- in-graph angles -----------------------------------------------------------------------------

ANGLE_ROPES = {"2m_yarn": seed_rope, "glm52_default": lambda: config.glm52().rope}
ANGLE_POSITIONS = {
    "near_0": np.arange(0, 68),
    "around_2**20": np.arange(2**20 - 34, 2**20 + 34),
    "2097100..2097167": np.arange(2_097_100, 2_097_168),
}


def angle_errors(rope, pos):
    """(max |error| of rope_angles, max |error| of naive float32 pos*inv_freq), both wrapped, in radians."""
    ref = exact_angles(pos, rope)
    ours = np.asarray(positions.rope_angles(jnp.asarray(pos, jnp.int32), positions.rotary_table(rope, 64)))
    assert ours.dtype == np.float32 and ours.shape == (len(pos), 32)
    assert ours.min() >= -math.pi and ours.max() <= math.pi
    naive = pos.astype(np.float32)[:, None] * positions.inv_freq(rope, 64).astype(np.float32)
    return (float(np.abs(wrap(ours.astype(np.float64) - ref)).max()),
            float(np.abs(wrap(naive.astype(np.float64) - ref)).max()))


def test_angle_accuracy():
    rows, ours_max, naive_max, naive_min_far = [], 0.0, 0.0, math.inf
    for rope_name, make_rope in ANGLE_ROPES.items():
        for pos_name, pos in ANGLE_POSITIONS.items():
            ours, naive = angle_errors(make_rope(), pos)
            rows.append(f"{rope_name:14s} {pos_name:18s} rope_angles {ours:.3e} rad   naive f32 {naive:.3e} rad")
            ours_max, naive_max = max(ours_max, ours), max(naive_max, naive)
            if pos_name != "near_0":
                naive_min_far = min(naive_min_far, naive)
    report = "\n".join([
        "Rotary angle error vs float64 pos*inv_freq (wrapped to [-pi, pi)), rotary dim 64:",
        *rows,
        f"max rope_angles error: {ours_max:.3e} rad (bound asserted: < 2e-6)",
        f"max naive float32 error: {naive_max:.3e} rad (asserted > 1e-2 at every far-position range)",
        f"reproduce (repository root): {ANGLE_COMMAND}",
    ])
    print("\n" + report)
    ANGLE_REPORT.write_text(report + "\n")
    assert ours_max < 2e-6
    assert naive_min_far > 1e-2


@pytest.mark.parametrize("make_rope", [
    seed_rope,
    lambda: yarn(DSV3_MAX, **{k: v for k, v in DSV3_YARN.items() if not k.startswith("mscale")}),
    lambda: yarn(DSV3_MAX, **DSV3_YARN, attention_factor=1.25),
    lambda: config.glm52().rope,
], ids=["2m_payload", "yarn_mscale_from_factor", "explicit_factor", "glm52_default"])
def test_rope_cos_sin(make_rope):
    rope = make_rope()
    table = positions.rotary_table(rope, 64)
    assert table.scale == positions.attention_factor(rope)
    pos = np.array([[0, 1, 2, 3, 4096, 65535], [2**20, 2**20 + 1, 1_999_999, 2_097_000, 2_097_166, 2_097_167]])
    cos, sin = positions.rope_cos_sin(jnp.asarray(pos, jnp.int32), table)
    assert cos.shape == sin.shape == (2, 6, 32) and cos.dtype == jnp.float32
    ref = exact_angles(pos, rope)
    np.testing.assert_allclose(np.asarray(cos), np.cos(ref) * table.scale, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), np.sin(ref) * table.scale, rtol=0, atol=1e-6)


def test_apply_interleaved_rope_matches_hf():
    rope, dim = seed_rope(), 16
    table = positions.rotary_table(rope, dim)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, dim, generator=gen)
    k = torch.randn(2, 3, 5, dim, generator=gen)
    pos = torch.randint(0, 2_097_168, (2, 5), generator=gen)
    freqs = torch.from_numpy(np.array(positions.rope_angles(jnp.asarray(pos.numpy(), jnp.int32), table)))
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's layout: [B, S, D]
    cos, sin = emb.cos() * table.scale, emb.sin() * table.scale
    hf_q, hf_k = hf_glm.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    half_cos = jnp.asarray(cos[..., : dim // 2].numpy())[:, None]  # [B, 1, S, R]
    half_sin = jnp.asarray(sin[..., : dim // 2].numpy())[:, None]
    for x, hf_x in ((q, hf_q), (k, hf_k)):
        ours = positions.apply_interleaved_rope(jnp.asarray(x.numpy()), half_cos, half_sin)
        assert ours.shape == x.shape and ours.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(ours), hf_x.numpy(), rtol=0, atol=1e-6)


def test_apply_interleaved_rope_keeps_dtype_and_relative_positions():
    table = positions.rotary_table(seed_rope(), 8)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8)), jnp.float32)

    def rotate(p, v):
        cos, sin = positions.rope_cos_sin(jnp.asarray(p, jnp.int32), table)
        return positions.apply_interleaved_rope(v, cos, sin)

    # q.k depends only on the position difference (same permutation for q and k).
    d1 = jnp.dot(rotate(2_000_000, x[0]), rotate(2_000_007, x[1]))
    d2 = jnp.dot(rotate(10, x[0]), rotate(17, x[1]))
    assert float(d1) == pytest.approx(float(d2), abs=1e-5)
    out = rotate(5, x[0].astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(rotate(5, x[0]).astype(jnp.bfloat16),
                                                                         np.float32), atol=1e-2)


# -- environment gating ----------------------------------------------------------------------------


def test_env_unset_or_empty_gives_none(monkeypatch):
    monkeypatch.delenv(positions.ROPE_SCALING_ENV, raising=False)
    assert positions.rope_scaling_from_env() is None
    monkeypatch.setenv(positions.ROPE_SCALING_ENV, "")
    assert positions.rope_scaling_from_env() is None


def test_env_set_gives_payload(monkeypatch, tmp_path):
    monkeypatch.setenv(positions.ROPE_SCALING_ENV, str(SCALING_2M))
    scaling = positions.rope_scaling_from_env()
    assert scaling == positions.load_rope_scaling(SCALING_2M)
    assert scaling.max_position_embeddings == 2097168 and scaling.rope.factor == 2.0000152587890625
    payload = seed_payload()
    payload["rope_parameters"]["beta_fast"] = 16.0
    monkeypatch.setenv(positions.ROPE_SCALING_ENV, str(write_payload(tmp_path, payload)))
    assert positions.rope_scaling_from_env().rope.beta_fast == 16.0


def test_env_names_missing_file(monkeypatch, tmp_path):
    path = tmp_path / "missing.json"
    monkeypatch.setenv(positions.ROPE_SCALING_ENV, str(path))
    with pytest.raises(ValueError, match=re.escape(f"rope scaling file {str(path)!r} does not exist")):
        positions.rope_scaling_from_env()


# -- validation errors -----------------------------------------------------------------------------


def rope_change(**changes):
    """A seed payload with rope_parameters changes (None deletes the key)."""
    payload = seed_payload()
    for key, value in changes.items():
        if value is None:
            del payload["rope_parameters"][key]
        else:
            payload["rope_parameters"][key] = value
    return payload


# (payload, message after the file path); every message names the key.
FILE_ERRORS = {
    "longrope": (rope_change(rope_type="longrope"), ".rope_parameters.rope_type: unsupported rope type 'longrope'"),
    "llama3": (rope_change(rope_type="llama3"), ".rope_parameters.rope_type: unsupported rope type 'llama3'"),
    "factor_2.0": (rope_change(factor=2.0), ".rope_parameters.factor: 2.0 is inconsistent with max_position_embeddings"
                                             " / original_max_position_embeddings = 2097168 / 1048576"),
    "factor_rel_1e-8": (rope_change(factor=2.0000152587890625 * (1 + 1e-8)), ".rope_parameters.factor: "),
    "factor_below_1": (rope_change(factor=0.5), ".rope_parameters.factor: must be >= 1, got 0.5"),
    "beta_equal": (rope_change(beta_fast=1.0), ".rope_parameters.beta_fast: must be greater than beta_slow"),
    "beta_inverted": (rope_change(beta_fast=2.0, beta_slow=4.0), ".rope_parameters.beta_fast: must be greater"),
    "missing_max": ({"rope_parameters": SEED_PAYLOAD["rope_parameters"]}, ".max_position_embeddings: missing"),
    "missing_rope": ({"max_position_embeddings": 2097168}, ".rope_parameters: missing"),
    "missing_rope_theta": (rope_change(rope_theta=None), ".rope_parameters.rope_theta: missing"),
    "missing_factor": (rope_change(factor=None), ".rope_parameters.factor: missing"),
    "missing_original": (rope_change(original_max_position_embeddings=None),
                         ".rope_parameters.original_max_position_embeddings: missing"),
    "missing_beta_fast": (rope_change(beta_fast=None), ".rope_parameters.beta_fast: missing"),
    "missing_beta_slow": (rope_change(beta_slow=None), ".rope_parameters.beta_slow: missing"),
    "string_factor": (rope_change(factor="2.0000152587890625"),
                      ".rope_parameters.factor: expected a finite number, got '2.0000152587890625'"),
    "bool_beta_fast": (rope_change(beta_fast=True), ".rope_parameters.beta_fast: expected a finite number, got True"),
    "string_max": ({**seed_payload(), "max_position_embeddings": "2097168"},
                   ".max_position_embeddings: expected a positive integer, got '2097168'"),
    "float_max": ({**seed_payload(), "max_position_embeddings": 2097168.0},
                  ".max_position_embeddings: expected a positive integer, got 2097168.0"),
    "float_original": (rope_change(original_max_position_embeddings=1048576.5),
                       ".rope_parameters.original_max_position_embeddings: expected a positive integer"),
    "theta_1": (rope_change(rope_theta=1.0), ".rope_parameters.rope_theta: must be > 1, got 1.0"),
    "attention_factor_0": (rope_change(attention_factor=0.0), ".rope_parameters.attention_factor: must be > 0"),
    "unknown_top_key": ({**seed_payload(), "note": "2M"}, ": unknown key(s) ['note']"),
    "unknown_rope_key": (rope_change(scale=2.0), ".rope_parameters: unknown key(s) ['scale'] for rope_type 'yarn'"),
    "default_with_factor": ({"max_position_embeddings": 2097168,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 8e6, "factor": 2.0}},
                            ".rope_parameters: unknown key(s) ['factor'] for rope_type 'default'"),
    "truncate_string": (rope_change(truncate="true"), ".rope_parameters.truncate: expected true/false, got 'true'"),
    "truncate_int": (rope_change(truncate=1), ".rope_parameters.truncate: expected true/false, got 1"),
    "not_an_object": ([SEED_PAYLOAD], ": expected a JSON object, got list"),
    "rope_not_an_object": ({"max_position_embeddings": 2097168, "rope_parameters": [1]},
                           ".rope_parameters: expected a JSON object, got list"),
}


@pytest.mark.parametrize("case", FILE_ERRORS)
def test_scaling_file_errors(case, tmp_path):
    payload, message = FILE_ERRORS[case]
    path = write_payload(tmp_path, payload)
    with pytest.raises(ValueError, match="^" + re.escape(str(path) + message)):
        positions.load_rope_scaling(path)


def test_factor_tolerance_is_1e_9_relative():
    for rel, ok in ((5e-10, True), (2e-9, False)):
        payload = rope_change(factor=2.0000152587890625 * (1 + rel))
        if ok:
            assert positions.parse_rope_scaling(payload).rope.factor == payload["rope_parameters"]["factor"]
        else:
            with pytest.raises(ValueError, match=re.escape("rope scaling.rope_parameters.factor: ")):
                positions.parse_rope_scaling(payload)


@pytest.mark.parametrize("key", ["factor", "beta_slow", "mscale", "rope_theta"])
def test_nan_is_rejected(key):
    with pytest.raises(ValueError, match=re.escape(f"rope scaling.rope_parameters.{key}: expected a finite number, "
                                                   "got nan")):
        positions.parse_rope_scaling(rope_change(**{key: float("nan")}))


def test_infinite_factor_is_rejected():
    with pytest.raises(ValueError, match=re.escape("rope scaling.rope_parameters.factor: expected a finite number")):
        positions.parse_rope_scaling(rope_change(factor=float("inf")))


def test_missing_scaling_file(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(ValueError, match=re.escape(f"rope scaling file {str(path)!r} does not exist")):
        positions.load_rope_scaling(path)


def test_invalid_json_scaling_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"max_position_embeddings": 2097168, ')
    with pytest.raises(ValueError, match=re.escape(f"rope scaling file {str(path)!r} is not valid JSON")):
        positions.load_rope_scaling(path)


def test_valid_variants_load(tmp_path):
    payload = {"max_position_embeddings": DSV3_MAX, "rope_parameters": {**DSV3_YARN, "truncate": False}}
    scaling = positions.load_rope_scaling(write_payload(tmp_path, payload))
    assert scaling.rope.truncate is False and scaling.rope.factor == 40.0
    default = positions.parse_rope_scaling(
        {"max_position_embeddings": 2**21, "rope_parameters": {"rope_type": "default", "rope_theta": 8e6}})
    assert default == positions.RopeScaling(2**21, positions.RopeParameters(rope_type="default", rope_theta=8e6))
