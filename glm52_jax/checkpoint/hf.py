"""HF checkpoint I/O: GLM-MoE-DSA safetensors <-> our stacked Flax parameters.

Loading reads `config.json`, checks every tensor's presence, shape and dtype against the config
from the headers alone, and only then reads data, one parameter at a time, each straight into its
(optionally sharded) device array: with a mesh, each device's callback reads just its own slice.
Routed experts may be stored per expert (`mlp.experts.E.gate_proj.weight`, as HF saves and GLM-5
releases ship) or fused 3-D (`mlp.experts.gate_up_proj`, HF's in-memory layout). Multi-token
prediction layers (`model.layers.{N}.*` for N >= num_hidden_layers) are skipped with a log line.
FP8 checkpoints' quantized weights stay e4m3 + block scales on device (`model.fp8`; read by `hf_fp8.py`).

Saving writes per-expert names, sharded with `model.safetensors.index.json` above
`max_shard_bytes`, into a temporary directory that replaces the files only when complete. A model with FP8
base weights is saved dequantized in its parameter dtype (`value x scale`, plus the LoRA delta when merging,
in float32, rounded once), or with a `quantization` config re-quantized in the release format: each weight
that is FP8 in the model as e4m3 `weight` + float32 `weight_scale_inv` on HF's [out, in] blocks, quantized
from the float32 merged tensor (`hf_fp8.quantize_hf`), so the loader reads it back as FP8.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.checkpoint import hf_fp8
from glm52_jax.checkpoint.safetensors_io import LazyTensor, SafetensorsFile, write_safetensors
from glm52_jax.config import ModelConfig
from glm52_jax.model import fp8
from glm52_jax.model.fp8 import Fp8Weight
from glm52_jax.model.lora import KernelDelta, kernel_adapters, merged_kernel
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.placement import sharding_for

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


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


# ------------------------------------------------------------------------------------------------
# Reading.


class _Checkpoint:
    """Tensor name -> lazily opened file, for a single file or an index-sharded checkpoint."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        single = os.path.join(path, SINGLE_FILE)
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise ValueError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found")
        self.files = {}
        for name in files:
            fp = os.path.join(path, name)
            if not os.path.exists(fp):
                raise ValueError(f"{index}: lists shard {name!r}, which does not exist")
            self.files[name] = SafetensorsFile(fp)
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for key in f.keys():
                self.where[key] = f
        if weight_map is not None:
            for key, fname in weight_map.items():
                if key not in self.where:
                    raise ValueError(f"{index}: tensor {key!r} is listed in {fname!r} but not stored there")

    def names(self) -> set[str]:
        return set(self.where)

    def info(self, name):
        return self.where[name].tensors[name]

    def get(self, name) -> np.ndarray:
        return self.where[name].get(name)


def _check_inventory(cfg: ModelConfig, ckpt: _Checkpoint, quant=None) -> tuple[bool, set[str]]:
    """Validates names, shapes, dtypes and FP8 scales from headers; returns (fused experts?, FP8 weight names)."""
    names = ckpt.names()
    mtp = sorted(n for n in names if (m := _LAYER_RE.match(n)) and int(m.group(1)) >= cfg.num_hidden_layers
                 and int(m.group(1)) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    if mtp:
        log.info("skipping %d multi-token-prediction tensors (layers >= %d)", len(mtp), cfg.num_hidden_layers)
        names -= set(mtp)
    scales = {n for n in names if n.endswith(hf_fp8.SCALE_SUFFIX)}
    names -= scales
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    expected = expected_tensors(cfg, fused_experts=fused)
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    extra_layers = sorted({int(m.group(1)) for n in unexpected if (m := _LAYER_RE.match(n))
                           and int(m.group(1)) >= cfg.num_hidden_layers})
    if extra_layers:
        raise ValueError(f"config.json does not match the weights: num_hidden_layers={cfg.num_hidden_layers} "
                         f"but the checkpoint has tensors for layer(s) {extra_layers}")
    if missing:
        raise ValueError(f"{ckpt.path}: missing tensor(s) {missing[:5]}" + (f" and {len(missing) - 5} more"
                                                                           if len(missing) > 5 else ""))
    if unexpected:
        raise ValueError(f"{ckpt.path}: unexpected tensor(s) {unexpected[:5]}" +
                         (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
    for name, shape in expected.items():
        info = ckpt.info(name)
        if info.shape != shape:
            raise ValueError(f"config.json does not match the weights: tensor {name!r} has shape {info.shape}, "
                             f"but the config implies {shape}")
    quantized = hf_fp8.check_scales(ckpt.path, ckpt.info, scales, expected, quant)
    for name in sorted(set(expected) - quantized):
        if (dtype := ckpt.info(name).dtype) not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; expected a float type {_FLOAT_DTYPES}")
    return fused, quantized


def _per_layer_reader(cfg: ModelConfig, ckpt: _Checkpoint, fused: bool, kind, rel_path, scales=None):
    """fn(layer, expert_slice) -> per-layer array in our layout (float32 or the stored float); with `scales`
    (HF scale grid -> ours), the FP8 block scales of those weights instead."""
    def get(name, to_ours):
        return to_ours(ckpt.get(name)) if scales is None else scales(ckpt.get(name + hf_fp8.SCALE_SUFFIX))

    if rel_path in _EXPERT_PARAMS:
        proj = _EXPERT_PARAMS[rel_path]
        i_moe = cfg.moe_intermediate_size

        def read_experts(layer, experts: slice):
            p = f"model.layers.{layer}.mlp.experts."
            ids = range(cfg.n_routed_experts)[experts]
            if fused:
                if proj == "down_proj":
                    a = ckpt.get(p + "down_proj")[experts]
                else:
                    a = ckpt.get(p + "gate_up_proj")[experts]
                    a = a[:, :i_moe] if proj == "gate_proj" else a[:, i_moe:]
                return _t(a)
            return np.stack([get(f"{p}{x}.{proj}.weight", _t) for x in ids])
        return read_experts, True
    spec = {lp.path: lp for lp in _layer_params(cfg, *kind)}[rel_path]
    return (lambda layer, _: get(f"model.layers.{layer}.{spec.hf}", spec.to_ours)), False


def _sources(cfg: ModelConfig, key: tuple) -> list[str]:
    """The HF weights our parameter `key` is read from: every layer of its stack (and every expert)."""
    if key[0] != "stacks":
        return []  # embedding, final norm, lm_head: never FP8 here (`hf_fp8.check_scales`)
    layers = [layer for layer, (s, _, slot) in sorted(_layer_map(cfg).items()) if (s, slot) == (key[1], key[3])]
    rel, kind = tuple(key[4:]), (cfg.mlp_layer_types[layers[0]], cfg.indexer_types[layers[0]])
    if rel in _EXPERT_PARAMS:
        return [f"model.layers.{i}.mlp.experts.{x}.{_EXPERT_PARAMS[rel]}.weight" for i in layers
                for x in range(cfg.n_routed_experts)]
    return [f"model.layers.{i}.{lp.hf}" for lp in _layer_params(cfg, *kind) if lp.path == rel for i in layers]


def fp8_key(cfg: ModelConfig, key: tuple, quant: hf_fp8.Fp8Config) -> bool:
    """Whether our base parameter `key` is FP8 when the model is quantized as `quant` says (`model.base_weights=
    "fp8"`: a float checkpoint as it is read, a random init, plan mode's abstract model): every HF weight it is
    read from (`_sources`) is one the release quantizes (`hf_fp8.quantizes`). Not the embedding, lm_head, norms,
    router, correction bias, nor (RELEASE) the indexer's weights_proj."""
    sources = _sources(cfg, key)
    return bool(sources) and all(hf_fp8.quantizes(name, quant) for name in sources)


def quantize_model(model: GlmMoeDsa, quant: hf_fp8.Fp8Config) -> GlmMoeDsa:
    """`model` (a random init) with each base weight `fp8_key` selects as an `Fp8Weight` on the block grid a
    loaded FP8 checkpoint of it would have (`hf_fp8.fp8_param`), quantized where it lives (`fp8.quantize`); the
    rest (and any LoRA) unchanged. Place it on a mesh afterwards (`placement.place_model`), as a random init."""
    graphdef, state = nnx.split(model)
    leaves = list(nnx.to_flat_state(state))
    chosen = [i for i, (key, var) in enumerate(leaves) if isinstance(var, nnx.Param)
              and not isinstance(var.get_value(), Fp8Weight) and fp8_key(model.cfg, key, quant)]
    blocks = [hf_fp8.fp8_param(model.cfg, quant, leaves[i][0], tuple(leaves[i][1].get_value().shape)).block
              for i in chosen]
    # One program for all of them (a compile per weight shape would dominate a tiny model's set-up).
    quantized = jax.jit(lambda weights: [fp8.quantize(w, b) for w, b in zip(weights, blocks)])(
        [leaves[i][1].get_value() for i in chosen])
    for i, value in zip(chosen, quantized):
        leaves[i] = (leaves[i][0], leaves[i][1].replace(value))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def param_reader(cfg: ModelConfig, ckpt, fused: bool, key: tuple, shape: tuple[int, ...], scales=None) -> Callable:
    """`read(index) -> np.ndarray`: our parameter `key` (of `shape`) at `index` (a tuple of slices), in our
    layout, from the HF tensors of `ckpt` (anything with `get(hf_name) -> np.ndarray`; `fused`: fused experts).
    With `scales` (one layer's HF scale grid -> ours; `shape` then the scale grid's), its FP8 block scales."""
    globals_ = {
        ("embed_tokens",): ("model.embed_tokens.weight", lambda a: a),
        ("norm", "weight"): ("model.norm.weight", lambda a: a),
        ("lm_head",): ("lm_head.weight", _t),
    }
    if key in globals_:
        name, fn = globals_[key]
        return lambda index: fn(ckpt.get(name))[index]
    if key[0] != "stacks" or key[2] != "layers":
        raise AssertionError(f"unmapped parameter {key}")
    layer_of = {v: k for k, v in _layer_map(cfg).items()}
    stack, slot, rel = key[1], key[3], tuple(key[4:])
    layer0 = layer_of[(stack, 0, slot)]
    kind = (cfg.mlp_layer_types[layer0], cfg.indexer_types[layer0])
    reader, is_expert = _per_layer_reader(cfg, ckpt, fused, kind, rel, scales)

    def read(index):
        reps = range(shape[0])[index[0]]
        expert_index = index[1] if is_expert else slice(None)
        rest = (slice(None),) + tuple(index[2:]) if is_expert else tuple(index[1:])
        parts = [np.asarray(reader(layer_of[(stack, rep, slot)], expert_index))[rest] for rep in reps]
        return np.stack(parts)
    return read


def load_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16, shardings=None,
                    options: ModelOptions | None = None, *, rope_scaling=None,
                    fp8: hf_fp8.Fp8Config | None = None) -> GlmMoeDsa:
    """Loads an HF GLM-MoE-DSA checkpoint directory into a `GlmMoeDsa`.

    dtype: parameter dtype (router, correction bias and indexer `weights_proj` stay float32); an FP8
      checkpoint's quantized weights stay e4m3 + block scales and compute in it (`model.fp8`).
    shardings: None (default device) or a `jax.sharding.Mesh`; with a mesh each parameter is
      sharded by its logical axis names (`parallel.rules`) and every device reads only its slice.
    rope_scaling: a `positions.RopeScaling` to apply; by default `$GLM52_ROPE_SCALING_JSON`'s, when set.
    fp8: quantize a float checkpoint as this FP8 release would be (`hf_fp8.RELEASE`: 128 x 128 blocks; the
      weights `fp8_key` selects), per HF tensor as it is read, then load it exactly as that FP8 checkpoint.
      An FP8 checkpoint loads as stored whatever this says.
    """
    path = os.fspath(path)
    quant, cfg = hf_fp8.split_quantization(ModelConfig.from_json_file(os.path.join(path, "config.json")))
    cfg = cfg.with_env_rope_scaling() if rope_scaling is None else cfg.with_rope_scaling(rope_scaling)
    # HF checkpoints hold no adapters: load the base, then attach fresh LoRA if the options ask for it.
    opts = dataclasses.replace(options or ModelOptions(), param_dtype=dtype, lora=None)
    abstract = nnx.eval_shape(lambda: GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    ckpt = _Checkpoint(path)
    if quant is None and fp8 is not None:  # a float checkpoint read as its FP8 release
        names = {name for key, _ in nnx.to_flat_state(state) if fp8_key(cfg, key, fp8) for name in _sources(cfg, key)}
        if absent := sorted(names - ckpt.names()):
            raise ValueError(f"{path}: quantizing to FP8 while loading needs per-expert tensors such as "
                             f"{absent[0]!r}; this checkpoint stores the experts fused (mlp.experts.gate_up_proj)")
        ckpt, quant = hf_fp8.QuantizedView(ckpt, names, fp8.block), fp8
    fused, quantized = _check_inventory(cfg, ckpt, quant)
    leaves = []
    for key, var in nnx.to_flat_state(state):
        shape, target = tuple(var.get_value().shape), var.get_value().dtype
        read = param_reader(cfg, ckpt, fused, key, shape)
        if hf_fp8.all_or_none(key, _sources(cfg, key), quantized):  # e4m3 values + block scales, read alike
            p = hf_fp8.fp8_param(cfg, quant, key, shape)
            scales = param_reader(cfg, ckpt, fused, key, p.scale_shape, scales=p.to_ours)
            leaves.append((key, var, hf_fp8.materialize(read, scales, p, shape, target, var, shardings)))
            continue
        leaves.append((key, var, _materialize(read, shape, target, var, shardings)))
    model = nnx.merge(graphdef, nnx.from_flat_state([(k, v.replace(value)) for k, v, value in leaves]))
    if options is not None and options.lora is not None:
        from glm52_jax.model.lora import attach_lora
        model = attach_lora(model, options.lora)
    return model


def _materialize(read, shape, dtype, var, mesh) -> jax.Array:
    def cast(a):
        return np.asarray(a).astype(np.float32).astype(dtype) if a.dtype != dtype else np.asarray(a)

    if mesh is None:
        full = tuple(slice(None) for _ in shape)
        return jnp.asarray(cast(read(full)))
    sharding = sharding_for(var, mesh)  # each process reads only its devices' slices (FSDP shards included)
    return jax.make_array_from_callback(shape, sharding, lambda index: cast(read(index)))


# ------------------------------------------------------------------------------------------------
# Writing.


@functools.cache
def _slicer(mesh: jax.sharding.Mesh, spec: tuple, n_lead: int) -> Callable:
    """Jitted `(x, index int32[n_lead]) -> x[index]` replicated on every device of `mesh`, for an `x`
    sharded by `spec` (one entry per axis). Written with shard_map so that each device touches only its
    own block: the devices holding `index` contribute the slice, the others -0.0 (x + -0.0 == x for every
    float x, so the sum over the indexed axes' shards is exact), then the slice's own sharded axes are
    all-gathered. Memory: one slice per device, never the whole of `x` (a plain dynamic_slice of a
    sharded axis makes XLA all-gather the operand)."""
    def names(entry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    def body(block, index):
        owner = jnp.bool_(True)
        for d in range(n_lead):
            n = block.shape[0]  # this device's share of axis d (the earlier indexed axes are gone)
            first = 0
            for name in names(spec[d]):
                first = first * mesh.shape[name] + jax.lax.axis_index(name)
            local = index[d] - first * n
            owner &= (local >= 0) & (local < n)
            block = jax.lax.dynamic_index_in_dim(block, jnp.clip(local, 0, n - 1), axis=0, keepdims=False)
        lead_names = tuple(n for entry in spec[:n_lead] for n in names(entry))
        if lead_names:
            block = jax.lax.psum(jnp.where(owner, block, jnp.asarray(-0.0, block.dtype)), lead_names)
        for d, entry in enumerate(spec[n_lead:]):
            if names(entry):
                block = jax.lax.all_gather(block, names(entry), axis=d, tiled=True)
        return block

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(*spec), P()), out_specs=P(), check_vma=False))


@jax.jit
def _local_index(x: jax.Array, index: jax.Array) -> jax.Array:
    for i in range(index.shape[0]):  # the positions are traced: one compile per shape, not per layer
        x = jax.lax.dynamic_index_in_dim(x, index[i], axis=0, keepdims=False)
    return x


def local_slice(x, index: tuple[int, ...] = ()) -> jax.Array:
    """`x[index]` (`index`: positions on the leading axes) whole on this process's first local device.

    A sharded `x` (of one process or several) is read with one collective that moves only the slice, so
    every process of a run must call this for the same arrays in the same order; a replicated one is
    read from this process's own copy. Host memory stays one slice, whatever the size of `x`."""
    pos = np.asarray(index, np.int32)
    device = jax.local_devices()[0]
    if not isinstance(x, jax.Array) or x.is_fully_replicated:
        local = x.addressable_data(0) if isinstance(x, jax.Array) else jnp.asarray(x, device=device)
        # A one-device program: outside any enclosing `jax.set_mesh` (export code may run under one), whose
        # devices jit would refuse to mix with this copy's single device.
        with jax.set_mesh(None):
            return jax.device_put(_local_index(local, pos), device)
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"local_slice: cannot read an array sharded by {type(sharding).__name__}")
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    pos = jax.make_array_from_callback(pos.shape, NamedSharding(sharding.mesh, P()), lambda i: pos[i])
    return jax.device_put(_slicer(sharding.mesh, spec, len(index))(x, pos).addressable_data(0), device)


class HostTransfers:
    """What `host_slice` has brought to this host since `reset`: how many arrays, their bytes, the largest."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.count = self.total_bytes = self.largest_bytes = 0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.total_bytes += nbytes
        self.largest_bytes = max(self.largest_bytes, nbytes)


host_transfers = HostTransfers()


def host_slice(x, index: tuple[int, ...] = ()) -> np.ndarray:
    """`local_slice(x, index)` as a numpy array (counted in `host_transfers`)."""
    out = np.asarray(jax.device_get(local_slice(x, index)))
    host_transfers.add(out.nbytes)
    return out


@functools.partial(jax.jit, static_argnames=("kd", "dtype"))
def _merged_slice(base, a, b, kd: KernelDelta | None, dtype) -> jax.Array:
    """One slice of a base kernel plus its LoRA delta `kd(a, b)` when `kd` is given (`merged_kernel`, the
    arithmetic of `merge_lora`), in `dtype`. An `Fp8Weight` is dequantized in float32 first (`value x scale`), so
    its merged value is rounded once: to float32 by the sum, then to `dtype`."""
    if isinstance(base, Fp8Weight):
        base = fp8.dense(dataclasses.replace(base, dtype=jnp.float32))
    return (base if kd is None else merged_kernel(base, kd(a, b))).astype(dtype)


def _local_part(value, index: tuple[int, ...]):
    """`local_slice` of an array, or of an `Fp8Weight`'s values and scales (its leading dims, the ones `index`
    takes, are unblocked: the scales have them too)."""
    if isinstance(value, Fp8Weight):
        return dataclasses.replace(value, values=local_slice(value.values, index),
                                   scales=local_slice(value.scales, index))
    return local_slice(value, index)


def _hf_tensors(model: GlmMoeDsa, *, merge_adapters: bool = False,
                fp8_block: tuple[int, int] | None = None) -> list[tuple[str, LazyTensor]]:
    """Every HF tensor of `model` as a lazily computed host array, in a stable order. Each is read (and with
    `merge_adapters`, merged with its LoRA delta on device: `W + scale * A B`, as `merge_lora` computes it)
    one tensor at a time: one layer's slice of a stacked kernel, one expert's of the routed experts.

    FP8 base weights are dequantized on device and written in their parameter dtype; with `fp8_block` (HF's
    weight_block_size) each is instead re-quantized from its float32 (merged) HF matrix: the e4m3 `weight`,
    then its `weight_scale_inv`, both from one computation."""
    cfg = model.cfg
    values = {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    adapters = kernel_adapters(model) if merge_adapters else {}
    out: list[tuple[str, LazyTensor]] = []

    def add(name, shape, dtype, fn):
        out.append((name, LazyTensor(shape, dtype, fn)))

    def host(key, index=(), dtype=None):
        """Our parameter `key` at leading positions `index` on the host, merged when asked, an FP8 weight
        dequantized; in `dtype` (default: the parameter's dtype)."""
        value = values[key]
        dtype = value.dtype if dtype is None else jnp.dtype(dtype)
        if key not in adapters and not isinstance(value, Fp8Weight) and dtype == value.dtype:
            return host_slice(value, index)
        a = b = kd = None
        if key in adapters:
            node, kd = adapters[key]
            a, b = (local_slice(v.get_value(), index) for v in (node.a, getattr(node, kd.b)))
        return host_slice(_merged_slice(_local_part(value, index), a, b, kd, dtype))

    def add_weight(name, shape, keys, to_hf):
        """HF weight `name` made by `to_hf(host)` from our parameters `keys`: as they are, or re-quantized."""
        if fp8_block is None or not all(isinstance(values[k], Fp8Weight) for k in keys):
            add(name, shape, values[keys[0]].dtype, lambda: to_hf(host))
            return
        pending = {}  # the scales of the weight just quantized, until the scale tensor (next in order) is read

        def quantized():  # from the float32 merge: rounded to e4m3 once, not first to the parameter dtype
            return hf_fp8.quantize_hf(to_hf(functools.partial(host, dtype=jnp.float32)), fp8_block)

        def weight():
            values, pending["scales"] = quantized()
            return values

        def scales():
            return pending.pop("scales") if "scales" in pending else quantized()[1]

        add(name, shape, fp8.E4M3, weight)
        add(name + hf_fp8.SCALE_SUFFIX, tuple(-(-n // b) for n, b in zip(shape, fp8_block)), np.float32, scales)

    emb, norm = values[("embed_tokens",)], values[("norm", "weight")]
    add("model.embed_tokens.weight", emb.shape, emb.dtype, lambda: host(("embed_tokens",)))
    add("model.norm.weight", norm.shape, norm.dtype, lambda: host(("norm", "weight")))
    if not cfg.tie_word_embeddings:
        lm = values[("lm_head",)]
        add("lm_head.weight", lm.shape[::-1], lm.dtype, lambda: _t(host(("lm_head",))))
    shapes = expected_tensors(cfg)
    for layer, (stack, rep, slot) in sorted(_layer_map(cfg).items()):
        kind = (cfg.mlp_layer_types[layer], cfg.indexer_types[layer])
        p = f"model.layers.{layer}."

        def key_of(rel, stack=stack, slot=slot):
            return ("stacks", stack, "layers", slot) + rel

        for lp in _layer_params(cfg, *kind):
            name = p + lp.hf
            if lp.to_hf is None:
                if lp.path[-1] != "w_uk":
                    continue
                uk, uv = key_of(("self_attn", "w_uk")), key_of(("self_attn", "w_uv"))

                def kv_b(get, uk=uk, uv=uv, rep=rep):
                    k, v = get(uk, (rep,)), get(uv, (rep,))  # [C,H,n], [C,H,v]
                    both = np.concatenate([k, v], axis=-1).transpose(1, 2, 0)  # [H, n+v, C]
                    return both.reshape(-1, both.shape[-1])
                add_weight(name, shapes[name], (uk, uv), kv_b)
                continue
            key = key_of(lp.path)
            add_weight(name, shapes[name], (key,), lambda get, key=key, rep=rep, f=lp.to_hf: f(get(key, (rep,))))
        if kind[0] == "sparse":
            for rel, proj in _EXPERT_PARAMS.items():
                key = key_of(rel)
                for x in range(cfg.n_routed_experts):
                    name = f"{p}mlp.experts.{x}.{proj}.weight"
                    add_weight(name, shapes[name], (key,), lambda get, key=key, rep=rep, x=x: _t(get(key, (rep, x))))
    return out


def save_pretrained(model: GlmMoeDsa, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
                    config: ModelConfig | None = None, merge_adapters: bool = False, write: bool = True,
                    quantization: dict | None = None) -> None:
    """Writes `config.json` and safetensors (per-expert names) that HF transformers loads.

    `config` is what config.json records (default: the model's own); it must describe the same
    weights, e.g. the model's config with its native positions instead of a run-time YaRN override.
    LoRA adapters are left out, or with `merge_adapters` merged into their kernels one tensor at a
    time (no merged copy of the model, on device or host). The model may be sharded over the
    processes of a run: each tensor is then gathered to every host in turn, so all of them call this,
    and only the one with `write` (process 0) writes; the others just take part in the gathers.

    FP8 base weights (`model.fp8`) are written dequantized in their parameter dtype, and config.json gets no
    `quantization_config` (one that `config` carries, e.g. the FP8 base's, is dropped); with `quantization`
    (an FP8 `quantization_config`, e.g. the base checkpoint's) they are re-quantized to e4m3 + block scales on
    its `weight_block_size` and config.json records it, so `load_pretrained` reads them back as FP8.

    Files are written into a temporary directory beside `path` and moved in only when all are
    complete, so an interrupted save leaves any previous checkpoint intact.
    """
    path = os.fspath(path)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    written_cfg = hf_fp8.with_quantization(model.cfg if config is None else config, quantization)
    fp8_block = None
    if quantization is not None:
        if not any(isinstance(v.get_value(), Fp8Weight) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))):
            raise ValueError("save_pretrained: a quantization config was given, but the model has no FP8 base "
                             "weights to write in it (load an FP8 checkpoint, or save without quantization)")
        fp8_block = hf_fp8.split_quantization(written_cfg)[0].block
    tensors = _hf_tensors(model, merge_adapters=merge_adapters, fp8_block=fp8_block)
    if not write:
        for _, t in tensors:  # the writer's order: every gather is a collective
            t.materialize()
        return
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    shards: list[list[tuple[str, LazyTensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = int(np.prod(t.shape)) * t.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    tmp = tempfile.mkdtemp(prefix=".glm52-save-", dir=parent)
    try:
        written_cfg.save_json(os.path.join(tmp, "config.json"))
        if len(shards) == 1:
            write_safetensors(os.path.join(tmp, SINGLE_FILE), shards[0])
            names = [SINGLE_FILE]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {}
            for fname, shard in zip(names, shards):
                write_safetensors(os.path.join(tmp, fname), shard)
                weight_map.update({n: fname for n, _ in shard})
            total = sum(int(np.prod(t.shape)) * t.dtype.itemsize for _, t in tensors)
            with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            names.append(INDEX_FILE)
        os.makedirs(path, exist_ok=True)
        for f in names + ["config.json"]:
            os.replace(os.path.join(tmp, f), os.path.join(path, f))
        # Then drop the previous layout's leftovers so the directory holds exactly one checkpoint.
        shards = [f for f in os.listdir(path) if re.fullmatch(r"model-\d+-of-\d+\.safetensors", f)]
        stale = [SINGLE_FILE, INDEX_FILE] + shards
        for f in stale:
            if f not in names and os.path.exists(os.path.join(path, f)):
                os.remove(os.path.join(path, f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
