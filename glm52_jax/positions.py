"""Rotary positions: default RoPE and YaRN, computed in-graph with accurate angles.

The frequencies and scales follow HF transformers' `_compute_yarn_parameters` and the DeepSeek
softmax-scale convention (`qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2`). One function,
`rope_cos_sin`, produces the rotation for every consumer (trainer, sampler, indexer) so they agree.

Angle accuracy. At position ~2**21 a float32 `pos * inv_freq` is off by up to ~0.1 rad (the product
has a 0.25 ulp and `inv_freq` itself is rounded). We instead store each frequency as a 64-bit
fixed-point fraction of a turn and compute `pos * freq mod 1 turn` with wrapping uint32 arithmetic
(exact) plus a tiny float32 correction, which keeps the angle error near float32 resolution of a
value in [-pi, pi) (about 5e-7 rad) for any position below 2**24.

Axis letters: S sequence, R rotary pairs (rotary_dim / 2), D rotary dim.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from glm52_jax.json_files import read_json

ROPE_SCALING_ENV = "GLM52_ROPE_SCALING_JSON"
SUPPORTED_ROPE_TYPES = ("default", "yarn")
_YARN_KEYS = (
    "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
)
_DEFAULT_KEYS = ("rope_type", "rope_theta")
_FACTOR_RTOL = 1e-9


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """Validated `rope_parameters` of a GLM-MoE-DSA config (`default` or `yarn`)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_dict(
        cls,
        params: Mapping[str, Any],
        *,
        max_position_embeddings: int,
        where: str = "rope_parameters",
        require_original: bool = False,
    ) -> RopeParameters:
        """Validates a rope dict; errors name the offending key as `where.key`.

        HF semantics: `type` is accepted for `rope_type`; a yarn dict without
        `original_max_position_embeddings` defaults it to `max_position_embeddings` (unless
        `require_original`), and a missing `factor` becomes max/original.
        """
        if not isinstance(params, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got {type(params).__name__}")
        params = dict(params)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.pop("type", None)
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{where}.rope_type: unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        allowed = _YARN_KEYS if rope_type == "yarn" else _DEFAULT_KEYS
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown} for rope_type {rope_type!r}")
        for key, value in params.items():
            if key == "rope_type" or value is None:
                continue
            if key == "truncate":
                if not isinstance(value, bool):
                    raise ValueError(f"{where}.truncate: expected true/false, got {value!r}")
            elif not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{where}.{key}: expected a finite number, got {value!r}")
        if "rope_theta" not in params or params["rope_theta"] is None:
            raise ValueError(f"{where}.rope_theta: missing")
        if params["rope_theta"] <= 1.0:
            raise ValueError(f"{where}.rope_theta: must be > 1, got {params['rope_theta']}")
        if rope_type == "default":
            return cls(rope_type="default", rope_theta=float(params["rope_theta"]))

        original = params.get("original_max_position_embeddings")
        if original is None:
            if require_original:
                raise ValueError(f"{where}.original_max_position_embeddings: missing")
            original = max_position_embeddings
        if float(original) != int(original) or original <= 0:
            raise ValueError(f"{where}.original_max_position_embeddings: expected a positive integer, got {original!r}")
        original = int(original)
        implicit = max_position_embeddings / original
        factor = params.get("factor")
        if factor is None:
            if require_original:
                raise ValueError(f"{where}.factor: missing")
            factor = implicit
        if factor < 1.0:
            raise ValueError(f"{where}.factor: must be >= 1, got {factor}")
        # HF tolerates implicit factor 1 (original defaulted to max); anything else must agree.
        if implicit != 1.0 and abs(factor - implicit) > _FACTOR_RTOL * factor:
            raise ValueError(
                f"{where}.factor: {factor} is inconsistent with max_position_embeddings / "
                f"original_max_position_embeddings = {max_position_embeddings} / {original} = {implicit}"
            )
        beta_fast = params.get("beta_fast")
        beta_slow = params.get("beta_slow")
        if (beta_fast or 32) <= (beta_slow or 1):
            raise ValueError(
                f"{where}.beta_fast: must be greater than beta_slow, got beta_fast={beta_fast} beta_slow={beta_slow}"
            )
        attention_factor = params.get("attention_factor")
        if attention_factor is not None and attention_factor <= 0:
            raise ValueError(f"{where}.attention_factor: must be > 0, got {attention_factor}")
        return cls(
            rope_type="yarn",
            rope_theta=float(params["rope_theta"]),
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=None if beta_fast is None else float(beta_fast),
            beta_slow=None if beta_slow is None else float(beta_slow),
            mscale=None if params.get("mscale") is None else float(params["mscale"]),
            mscale_all_dim=None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"]),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(params.get("truncate", True)),
        )

    def to_dict(self) -> dict[str, Any]:
        """HF `rope_parameters` dict (only keys that are set)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "default":
            return out
        for field in _YARN_KEYS[2:]:
            value = getattr(self, field)
            if value is not None:
                out[field] = value
        return out


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A position-extension payload: new max positions plus the rope parameters to use."""

    max_position_embeddings: int
    rope: RopeParameters


def parse_rope_scaling(payload: Mapping[str, Any], *, where: str = "rope scaling") -> RopeScaling:
    """Validates a scaling payload `{"max_position_embeddings": N, "rope_parameters": {...}}`."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"max_position_embeddings", "rope_parameters"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}")
    for key in ("max_position_embeddings", "rope_parameters"):
        if key not in payload:
            raise ValueError(f"{where}.{key}: missing")
    max_pos = payload["max_position_embeddings"]
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos <= 0:
        raise ValueError(f"{where}.max_position_embeddings: expected a positive integer, got {max_pos!r}")
    rope = RopeParameters.from_dict(
        payload["rope_parameters"], max_position_embeddings=max_pos,
        where=f"{where}.rope_parameters", require_original=True,
    )
    if rope.rope_type == "yarn":
        for key in ("beta_fast", "beta_slow"):
            if getattr(rope, key) is None:
                raise ValueError(f"{where}.rope_parameters.{key}: missing")
    return RopeScaling(max_position_embeddings=max_pos, rope=rope)


def load_rope_scaling(path: str | os.PathLike) -> RopeScaling:
    """Reads and validates a scaling JSON file."""
    return parse_rope_scaling(read_json(path, "rope scaling"), where=str(path))


def rope_scaling_from_env() -> RopeScaling | None:
    """The payload named by `$GLM52_ROPE_SCALING_JSON`, or None when it is unset or empty."""
    path = os.environ.get(ROPE_SCALING_ENV, "")
    return load_rope_scaling(path) if path else None


# ----------------------------------------------------------------------------------------------
# Frequencies and scales (host side, float64).


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(rope: RopeParameters, dim: int) -> np.ndarray:
    """Inverse frequencies `[dim // 2]` in float64 (HF's formula, without its float32 rounding)."""
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    base = rope.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return extrapolation
    factor = rope.factor
    interpolation = 1.0 / (factor * pos_freqs)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_factor = 1.0 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def attention_factor(rope: RopeParameters) -> float:
    """Scale HF applies to cos and sin (1 for default RoPE)."""
    if rope.rope_type == "default":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_get_mscale(rope.factor)


def softmax_scale(rope: RopeParameters, qk_head_dim: int) -> float:
    """MLA softmax scale: `qk_head_dim**-0.5`, times `mscale(factor, mscale_all_dim)**2` under YaRN."""
    scale = qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


# ----------------------------------------------------------------------------------------------
# In-graph angles.


@dataclasses.dataclass(frozen=True)
class RotaryTable:
    """Per-frequency constants for exact modular angles; build once per model with `rotary_table`."""

    turns_hi: np.ndarray  # [R] uint32: floor(frac(freq / 2pi) * 2**32)
    turns_lo: np.ndarray  # [R] float32: remaining fraction of a turn, already scaled by 2**-32
    scale: float  # attention_factor applied to cos and sin


def rotary_table(rope: RopeParameters, dim: int) -> RotaryTable:
    freqs = inv_freq(rope, dim)
    turns = freqs / (2.0 * math.pi)
    frac = turns - np.floor(turns)
    scaled = frac * 2.0 ** 32
    hi = np.floor(scaled)
    lo = (scaled - hi) * 2.0 ** -32
    return RotaryTable(hi.astype(np.uint32), lo.astype(np.float32), attention_factor(rope))


def rope_angles(positions: jax.Array, table: RotaryTable) -> jax.Array:
    """Angles in [-pi, pi): `positions: [...] int -> [..., R] float32`, accurate for positions < 2**24."""
    pos_u32 = positions.astype(jnp.uint32)[..., None]
    # Wrapping uint32 product = the top 32 fractional bits of pos * freq, in turns, exactly.
    coarse = jax.lax.bitcast_convert_type(pos_u32 * jnp.asarray(table.turns_hi), jnp.int32)
    turns = coarse.astype(jnp.float32) * jnp.float32(2.0 ** -32)
    turns = turns + positions.astype(jnp.float32)[..., None] * jnp.asarray(table.turns_lo)
    turns = turns - jnp.round(turns)
    return turns * jnp.float32(2.0 * math.pi)


def rope_cos_sin(positions: jax.Array, table: RotaryTable) -> tuple[jax.Array, jax.Array]:
    """`positions: [...] -> (cos, sin): [..., R]` float32, scaled by the YaRN attention factor."""
    angles = rope_angles(positions, table)
    return jnp.cos(angles) * table.scale, jnp.sin(angles) * table.scale


def apply_interleaved_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates interleaved pairs (x0, x1), (x2, x3), ... and returns HF's layout.

    `x: [..., D]`, `cos/sin` broadcastable to `[..., D // 2]`. Like HF's
    `apply_rotary_pos_emb_interleave`, the output holds all rotated even slots first, then all odd
    slots; queries and keys get the same permutation, so their dot products are unchanged.
    """
    x1 = x[..., 0::2].astype(jnp.float32)
    x2 = x[..., 1::2].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
