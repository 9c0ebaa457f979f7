"""HF checkpoint I/O: GLM-MoE-DSA safetensors <-> our stacked Flax parameters.

Loading reads `config.json`, checks every tensor's presence, shape and dtype against the config
from the headers alone, and only then reads data, one parameter at a time, each straight into its
(optionally sharded) device array: with a mesh, each device's callback reads just its own slice.
Routed experts may be stored per expert (`mlp.experts.E.gate_proj.weight`, as HF saves and GLM-5
releases ship) or fused 3-D (`mlp.experts.gate_up_proj`, HF's in-memory layout). Multi-token
prediction layers (`model.layers.{N}.*` for N >= num_hidden_layers) are skipped with a log line.
FP8 checkpoints' quantized weights stay e4m3 + block scales on device (`model.fp8`; read by `hf_fp8.py`).

Saving (`hf_save.py`, re-exported here) writes per-expert names, sharded with `model.safetensors.index.json` above
`max_shard_bytes`, into a temporary directory that replaces the files only when complete. A model with FP8
base weights is saved dequantized in its parameter dtype (`value x scale`, plus the LoRA delta when merging,
in float32, rounded once), or with a `quantization` config re-quantized in the release format: each weight
that is FP8 in the model as e4m3 `weight` + float32 `weight_scale_inv` on HF's [out, in] blocks, quantized
from the float32 merged tensor (`hf_fp8.quantize_hf`), so the loader reads it back as FP8.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax.checkpoint import hf_fp8
from glm52_jax.checkpoint.hf_layout import (  # noqa: F401 (re-exported: the layout is part of this module's API)
    _EXPERT_PARAMS,
    INDEX_FILE,
    SINGLE_FILE,
    _kv_b_part,
    _layer_map,
    _layer_params,
    _t,
    expected_tensors,
)
from glm52_jax.checkpoint.hf_save import _hf_tensors, save_pretrained  # noqa: F401 (re-exported)
from glm52_jax.checkpoint.host_slice import host_slice, host_transfers, local_slice  # noqa: F401 (re-exported)
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.config import ModelConfig
from glm52_jax.model import fp8
from glm52_jax.model.fp8 import Fp8Weight
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.placement import sharding_for

log = logging.getLogger(__name__)

_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


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
