"""The HF layout of GLM-MoE-DSA: tensor names and shapes a config implies, and each per-layer parameter's transform
between HF's tensors ([out, in] linear weights) and ours ([in, ..., out], stacked by layer segment). Shared by
reading (`hf.py`), writing (`hf_save.py`), the PEFT/Megatron adapter files and plan mode; reads no data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from glm52_jax.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ------------------------------------------------------------------------------------------------
# Layout transforms between HF tensors ([out, in] linear weights) and ours ([in, ..., out]).


def _t(a):
    return np.swapaxes(a, -1, -2)


def _q_b(cfg):  # [H*(n+r), Q] <-> [Q, H, n+r]
    h, e = cfg.num_attention_heads, cfg.qk_head_dim
    return (lambda a: a.reshape(h, e, -1).transpose(2, 0, 1),
            lambda o: o.transpose(1, 2, 0).reshape(h * e, -1))


def _wq_b(cfg):  # [IH*ID, Q] <-> [Q, IH, ID]
    h, d = cfg.index_n_heads, cfg.index_head_dim
    return (lambda a: a.reshape(h, d, -1).transpose(2, 0, 1),
            lambda o: o.transpose(1, 2, 0).reshape(h * d, -1))


def _o(cfg):  # [D, H*V] <-> [H, V, D]
    h, v = cfg.num_attention_heads, cfg.v_head_dim
    return (lambda a: a.reshape(a.shape[0], h, v).transpose(1, 2, 0),
            lambda o: o.transpose(2, 0, 1).reshape(o.shape[2], h * v))


def _kv_b_part(cfg, part):  # [H*(n+v), C] -> [C, H, n] or [C, H, v]
    h, n = cfg.num_attention_heads, cfg.qk_nope_head_dim
    def to_ours(a):
        a = a.reshape(h, -1, a.shape[-1])
        a = a[:, :n] if part == "k" else a[:, n:]
        return a.transpose(2, 0, 1)
    return to_ours


@dataclasses.dataclass(frozen=True)
class _LayerParam:
    """One per-layer parameter: our path inside a DecoderLayer, and how it maps to HF tensors."""

    path: tuple[str, ...]
    hf: str  # suffix after `model.layers.{i}.`
    to_ours: Callable
    to_hf: Callable | None  # None: written together with another parameter (kv_b)


def _layer_params(cfg: ModelConfig, mlp_type: str, indexer_type: str) -> list[_LayerParam]:
    ident = lambda a: a  # noqa: E731
    q_b, wq_b, o = _q_b(cfg), _wq_b(cfg), _o(cfg)
    out = [
        _LayerParam(("input_layernorm", "weight"), "input_layernorm.weight", ident, ident),
        _LayerParam(("post_attention_layernorm", "weight"), "post_attention_layernorm.weight", ident, ident),
        _LayerParam(("self_attn", "q_a_proj"), "self_attn.q_a_proj.weight", _t, _t),
        _LayerParam(("self_attn", "q_a_layernorm", "weight"), "self_attn.q_a_layernorm.weight", ident, ident),
        _LayerParam(("self_attn", "q_b_proj"), "self_attn.q_b_proj.weight", *q_b),
        _LayerParam(("self_attn", "kv_a_proj_with_mqa"), "self_attn.kv_a_proj_with_mqa.weight", _t, _t),
        _LayerParam(("self_attn", "kv_a_layernorm", "weight"), "self_attn.kv_a_layernorm.weight", ident, ident),
        _LayerParam(("self_attn", "w_uk"), "self_attn.kv_b_proj.weight", _kv_b_part(cfg, "k"), None),
        _LayerParam(("self_attn", "w_uv"), "self_attn.kv_b_proj.weight", _kv_b_part(cfg, "v"), None),
        _LayerParam(("self_attn", "o_proj"), "self_attn.o_proj.weight", *o),
    ]
    if indexer_type == "full":
        out += [
            _LayerParam(("self_attn", "indexer", "wq_b"), "self_attn.indexer.wq_b.weight", *wq_b),
            _LayerParam(("self_attn", "indexer", "wk"), "self_attn.indexer.wk.weight", _t, _t),
            _LayerParam(("self_attn", "indexer", "k_norm", "weight"), "self_attn.indexer.k_norm.weight", ident, ident),
            _LayerParam(("self_attn", "indexer", "k_norm", "bias"), "self_attn.indexer.k_norm.bias", ident, ident),
            _LayerParam(("self_attn", "indexer", "weights_proj"), "self_attn.indexer.weights_proj.weight", _t, _t),
        ]
    mlp_prefix = "mlp.shared_experts." if mlp_type == "sparse" else "mlp."
    mlp_path = ("mlp", "shared_experts") if mlp_type == "sparse" else ("mlp",)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out.append(_LayerParam(mlp_path + (proj,), f"{mlp_prefix}{proj}.weight", _t, _t))
    if mlp_type == "sparse":
        out += [
            _LayerParam(("mlp", "router"), "mlp.gate.weight", _t, _t),
            _LayerParam(("mlp", "e_score_correction_bias"), "mlp.gate.e_score_correction_bias", ident, ident),
        ]
    return out


_EXPERT_PARAMS = {("mlp", "w_gate"): "gate_proj", ("mlp", "w_up"): "up_proj", ("mlp", "w_down"): "down_proj"}


def _layer_map(model_or_cfg) -> dict[int, tuple[int, int, int]]:
    """layer id -> (stack index, repeat, slot in unit)."""
    from glm52_jax.model.transformer import layer_kinds, plan_segments
    cfg = model_or_cfg if isinstance(model_or_cfg, ModelConfig) else model_or_cfg.cfg
    out = {}
    for s, seg in enumerate(plan_segments(layer_kinds(cfg))):
        for rep in range(seg.repeats):
            for slot in range(len(seg.unit)):
                out[seg.start + rep * len(seg.unit) + slot] = (s, rep, slot)
    return out


def expected_tensors(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its shape."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    h, n, r, vd, c, q = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank, cfg.q_lora_rank)
    ih, idim, e, i_moe = cfg.index_n_heads, cfg.index_head_dim, cfg.n_routed_experts, cfg.moe_intermediate_size
    for layer, (mlp_type, indexer_type) in enumerate(zip(cfg.mlp_layer_types, cfg.indexer_types)):
        p = f"model.layers.{layer}."
        shapes = {
            "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
            "self_attn.q_a_proj.weight": (q, d), "self_attn.q_a_layernorm.weight": (q,),
            "self_attn.q_b_proj.weight": (h * (n + r), q), "self_attn.kv_a_proj_with_mqa.weight": (c + r, d),
            "self_attn.kv_a_layernorm.weight": (c,), "self_attn.kv_b_proj.weight": (h * (n + vd), c),
            "self_attn.o_proj.weight": (d, h * vd),
        }
        if indexer_type == "full":
            shapes.update({
                "self_attn.indexer.wq_b.weight": (ih * idim, q), "self_attn.indexer.wk.weight": (idim, d),
                "self_attn.indexer.k_norm.weight": (idim,), "self_attn.indexer.k_norm.bias": (idim,),
                "self_attn.indexer.weights_proj.weight": (ih, d),
            })
        if mlp_type == "dense":
            ii = cfg.intermediate_size
            shapes.update({"mlp.gate_proj.weight": (ii, d), "mlp.up_proj.weight": (ii, d),
                           "mlp.down_proj.weight": (d, ii)})
        else:
            si = i_moe * cfg.n_shared_experts
            shapes.update({
                "mlp.shared_experts.gate_proj.weight": (si, d), "mlp.shared_experts.up_proj.weight": (si, d),
                "mlp.shared_experts.down_proj.weight": (d, si),
                "mlp.gate.weight": (e, d), "mlp.gate.e_score_correction_bias": (e,),
            })
            if fused_experts:
                shapes.update({"mlp.experts.gate_up_proj": (e, 2 * i_moe, d), "mlp.experts.down_proj": (e, d, i_moe)})
            else:
                for x in range(e):
                    shapes.update({f"mlp.experts.{x}.gate_proj.weight": (i_moe, d),
                                   f"mlp.experts.{x}.up_proj.weight": (i_moe, d),
                                   f"mlp.experts.{x}.down_proj.weight": (d, i_moe)})
        out.update({p + k: s for k, s in shapes.items()})
    return out
