"""Writing an HF checkpoint (`save_pretrained`): per-expert names, sharded with `model.safetensors.index.json`
above `max_shard_bytes`, into a temporary directory that replaces the files only when complete. Each tensor is
computed lazily, one at a time (`host_slice`), merged with its LoRA delta on device when asked, an FP8 base weight
dequantized or re-quantized in the release format (`hf_fp8.quantize_hf`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax.checkpoint import hf_fp8
from glm52_jax.checkpoint.hf_layout import (
    _EXPERT_PARAMS,
    INDEX_FILE,
    SINGLE_FILE,
    _layer_map,
    _layer_params,
    _t,
    expected_tensors,
)
from glm52_jax.checkpoint.host_slice import host_slice, local_slice
from glm52_jax.checkpoint.safetensors_io import LazyTensor, write_safetensors
from glm52_jax.config import ModelConfig
from glm52_jax.model import fp8
from glm52_jax.model.fp8 import Fp8Weight
from glm52_jax.model.lora import KernelDelta, kernel_adapters, merged_kernel
from glm52_jax.model.transformer import GlmMoeDsa


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
