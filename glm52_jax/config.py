"""ModelConfig: the GLM-MoE-DSA architecture, read from and written to HF `config.json`.

Field names and defaults follow HF transformers 5.24 `GlmMoeDsaConfig`; derived per-layer lists
(`indexer_types`, `mlp_layer_types`) are resolved exactly as HF's `__post_init__` does. Keys HF
carries but the math does not use are kept in `extra` so a round trip loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from glm52_jax import positions
from glm52_jax.json_files import read_json

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")

# Keys consumed while deriving other fields; never stored as fields themselves.
_DERIVATION_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "rope_scaling",
                    "rope_theta", "num_local_experts", "num_experts", "head_dim", "qk_head_dim", "layer_types")
# Keys HF writes that describe the file, not the model.
_IGNORED_KEYS = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype",
                 "output_router_logits", "use_cache")
# Known GLM-5 keys whose only supported value is the one our math implements.
_FIXED_VALUE_KEYS = {
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_interleave": True,
    "indexer_rope_interleave": True,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GLM-MoE-DSA model (HF `GlmMoeDsaConfig` fields)."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    indexer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rope: positions.RopeParameters = positions.RopeParameters()
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    num_nextn_predict_layers: int = 0
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        n = self.num_hidden_layers
        # Derive only from integer inputs; otherwise validate() names the bad field.
        if not self.indexer_types and _is_int(n):
            object.__setattr__(self, "indexer_types", derive_indexer_types(n))
        if not self.mlp_layer_types and _is_int(n) and _is_int(self.first_k_dense_replace):
            k = min(self.first_k_dense_replace, n)
            object.__setattr__(self, "mlp_layer_types", ("dense",) * k + ("sparse",) * (n - k))
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos))
        self.validate()

    # -- derived ----------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return positions.softmax_scale(self.rope, self.qk_head_dim)

    def validate(self) -> None:
        def require(ok: bool, field: str, why: str):
            if not ok:
                raise ValueError(f"ModelConfig.{field}: {why}")

        for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                      "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_routed_experts",
                      "num_experts_per_tok", "n_group", "topk_group", "kv_lora_rank", "q_lora_rank",
                      "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim",
                      "index_n_heads", "max_position_embeddings"):
            value = getattr(self, field)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0, field,
                    f"expected a positive integer, got {value!r}")
        for field in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            value = getattr(self, field)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, field,
                    f"expected a non-negative integer, got {value!r}")
        n = self.num_hidden_layers
        require(len(self.indexer_types) == n, "indexer_types",
                f"has {len(self.indexer_types)} entries for num_hidden_layers={n}")
        bad = sorted({t for t in self.indexer_types if t not in INDEXER_TYPES})
        require(not bad, "indexer_types", f"unknown value(s) {bad}; expected {INDEXER_TYPES}")
        require(self.indexer_types[0] == "full", "indexer_types",
                "layer 0 is 'shared' but a shared layer needs a previous 'full' layer's top-k")
        require(len(self.mlp_layer_types) == n, "mlp_layer_types",
                f"has {len(self.mlp_layer_types)} entries for num_hidden_layers={n}")
        bad = sorted({t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES})
        require(not bad, "mlp_layer_types", f"unknown value(s) {bad}; expected {MLP_LAYER_TYPES}")
        require(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
                f"MLA needs num_key_value_heads == num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_key_value_heads}")
        require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        require(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
                f"{self.index_head_dim} is smaller than qk_rope_head_dim={self.qk_rope_head_dim}")
        require(self.n_routed_experts % self.n_group == 0, "n_group",
                f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        require(self.n_group == 1 or self.n_routed_experts // self.n_group >= 2, "n_group",
                "each expert group needs at least 2 experts (group score = sum of its top-2)")
        require(self.topk_group <= self.n_group, "topk_group",
                f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        eligible = self.topk_group * (self.n_routed_experts // self.n_group)
        require(self.num_experts_per_tok <= eligible, "num_experts_per_tok",
                f"{self.num_experts_per_tok} experts per token but only {eligible} are eligible "
                f"(topk_group={self.topk_group} groups of {self.n_routed_experts // self.n_group})")
        require(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        require(not self.attention_bias, "attention_bias", "attention biases are not supported (GLM-5 has none)")
        eps = self.rms_norm_eps
        require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0, "rms_norm_eps",
                f"must be a number > 0, got {eps!r}")
        for field in ("pad_token_id", "bos_token_id"):
            value = getattr(self, field)
            require(value is None or (isinstance(value, int) and 0 <= value < self.vocab_size), field,
                    f"{value!r} is not a token id below vocab_size={self.vocab_size}")
        require(all(isinstance(e, int) and 0 <= e < self.vocab_size for e in self.eos_token_id), "eos_token_id",
                f"{self.eos_token_id} has ids outside [0, vocab_size={self.vocab_size})")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # -- HF config.json -----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a parsed HF `config.json` dict (legacy rope keys accepted)."""
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type != MODEL_TYPE:
            raise ValueError(f"config.model_type: expected {MODEL_TYPE!r}, got {model_type!r}")
        for key, expected in _FIXED_VALUE_KEYS.items():
            if key in raw and raw[key] != expected:
                raise ValueError(f"config.{key}: only {expected!r} is supported, got {raw[key]!r}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope", "extra"}
        defaults = cls.__dataclass_fields__
        kwargs: dict[str, Any] = {}
        for name in fields:
            if name in raw and raw[name] is not None:
                kwargs[name] = raw[name]
        for alias in ("num_local_experts", "num_experts"):
            if raw.get(alias) is not None:
                kwargs["n_routed_experts"] = raw[alias]
        if raw.get("n_shared_experts", 0) is None:
            kwargs["n_shared_experts"] = 0
        num_layers = kwargs.get("num_hidden_layers", defaults["num_hidden_layers"].default)
        if raw.get("indexer_types") is not None:
            kwargs["indexer_types"] = tuple(raw["indexer_types"])
        else:
            kwargs["indexer_types"] = derive_indexer_types(
                num_layers, pattern=raw.get("index_topk_pattern"),
                freq=raw.get("index_topk_freq", 1), offset=raw.get("index_skip_topk_offset", 2))
        if raw.get("mlp_layer_types") is not None:
            kwargs["mlp_layer_types"] = tuple(raw["mlp_layer_types"])
        if "eos_token_id" in raw:
            kwargs["eos_token_id"] = raw["eos_token_id"]
        if "pad_token_id" in raw:
            kwargs["pad_token_id"] = raw["pad_token_id"]
        if "bos_token_id" in raw:
            kwargs["bos_token_id"] = raw["bos_token_id"]
        max_pos = kwargs.get("max_position_embeddings", defaults["max_position_embeddings"].default)
        kwargs["rope"] = _rope_from_hf(raw, max_pos)
        known = fields | set(_DERIVATION_KEYS) | set(_IGNORED_KEYS) | {"rope_parameters"}
        kwargs["extra"] = tuple(sorted((k, v) for k, v in raw.items() if k not in known))
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict HF transformers' `GlmMoeDsaConfig` loads to the same model."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in dataclasses.fields(self):
            if f.name in ("rope", "extra", "eos_token_id", "indexer_types", "mlp_layer_types"):
                continue
            out[f.name] = getattr(self, f.name)
        out["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        out["indexer_types"] = list(self.indexer_types)
        out["mlp_layer_types"] = list(self.mlp_layer_types)
        out["rope_parameters"] = self.rope.to_dict()
        out.update(dict(self.extra))
        return out

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> ModelConfig:
        return cls.from_hf_dict(read_json(path, "config"))

    def save_json(self, path: str | os.PathLike) -> None:
        """Writes `config.json` atomically."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(), f, indent=2, sort_keys=True)
        os.replace(tmp, path)

    def with_rope_scaling(self, scaling: positions.RopeScaling) -> ModelConfig:
        """This config with an explicit position-extension payload applied."""
        if scaling.rope.rope_theta != self.rope.rope_theta:
            raise ValueError(
                f"rope scaling rope_theta={scaling.rope.rope_theta} differs from the model's "
                f"rope_theta={self.rope.rope_theta}")
        return self.replace(max_position_embeddings=scaling.max_position_embeddings, rope=scaling.rope)

    def with_env_rope_scaling(self) -> ModelConfig:
        """Applies `$GLM52_ROPE_SCALING_JSON` when set; returns self unchanged otherwise."""
        scaling = positions.rope_scaling_from_env()
        return self if scaling is None else self.with_rope_scaling(scaling)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def derive_indexer_types(num_layers: int, *, pattern: Any = None, freq: int = 1, offset: int = 2) -> tuple[str, ...]:
    """HF's derivation: a pattern ('F'/'S' string or list) wins, else the freq/offset schedule."""
    if pattern is not None:
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - {"F", "S"})
            if bad:
                raise ValueError(f"config.index_topk_pattern: characters {bad} are not 'F' or 'S'")
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    checked = (("num_hidden_layers", num_layers), ("index_topk_freq", freq), ("index_skip_topk_offset", offset))
    for name, value in checked:
        if not _is_int(value):
            raise ValueError(f"config.{name}: expected an integer, got {value!r}")
    freq = max(freq, 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def _rope_from_hf(raw: Mapping[str, Any], max_pos: int) -> positions.RopeParameters:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    params = dict(params)
    if "rope_theta" not in params:
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    return positions.RopeParameters.from_dict(params, max_position_embeddings=max_pos, where="config.rope_parameters")


def glm52() -> ModelConfig:
    """GLM-5.2 as released: native 1M positions, IndexShare (21 full / 57 shared indexers)."""
    return ModelConfig(
        max_position_embeddings=1_048_576,
        rope=positions.RopeParameters(rope_type="default", rope_theta=8_000_000.0),
        indexer_types=derive_indexer_types(78, freq=4, offset=3),
        pad_token_id=154820,
        eos_token_id=(154820, 154827, 154829),
        num_nextn_predict_layers=1,
    )


def tiny(**overrides) -> ModelConfig:
    """A laptop-sized model with every GLM-5.2 feature: dense + MoE layers, IndexShare, groups."""
    base = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=32,
        index_topk=32, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
        indexer_types=derive_indexer_types(6, freq=2, offset=2),
        max_position_embeddings=65536,
        rope=positions.RopeParameters(rope_type="default", rope_theta=10000.0),
        # Ids of the shipped tiny tokenizer: [gMASK]=0, <|endoftext|>=1, <|user|>=4, <|pad|>=6.
        eos_token_id=(1, 4), bos_token_id=0, pad_token_id=6,
    )
    base.update(overrides)
    return ModelConfig(**base)


PRESETS = {"tiny": tiny, "glm52": glm52}  # by name, as `model.preset` chooses (glm52_jax.choices.PRESETS)
