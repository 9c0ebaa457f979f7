"""Tiny HF FP8 checkpoints for tests, written with numpy and the reference `safetensors` library.

`random_tensors` draws every tensor a config implies (wide weights, as `hf_reference.random_hf_model`); an
FP8 checkpoint quantizes the chosen `[out, in]` weights with the DeepSeek-V3 block rule, written here
independently of the package: per `b0 x b1` block of the HF matrix (a partial last block on its own) scale =
amax / 448 (e4m3's largest finite value), stored `weight_scale_inv`; value = round-to-e4m3(w / scale). The
same numbers, dequantized in HF's layout (value x its block's scale, one float32 product), make the plain
float32 checkpoint the FP8 model is compared against.
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np
import safetensors.numpy

from glm52_jax.checkpoint import hf as hf_io
from glm52_jax.config import ModelConfig

E4M3_MAX = 448.0
# Every HF module our model can hold in FP8, as a release quantizes them; the indexer's weights_proj stays
# unquantized (listed in modules_to_not_convert), as DeepSeek-V3.2 keeps it.
QUANTIZED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "gate_proj",
             "up_proj", "down_proj")
NOT_CONVERT = ["indexer.weights_proj"]


def random_tensors(cfg: ModelConfig, seed: int = 0, std: float = 0.08) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_io.expected_tensors(cfg).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            out[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("k_norm.bias", "e_score_correction_bias")):
            out[name] = 0.1 * rng.standard_normal(shape)
        else:
            out[name] = std * rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


def is_quantized(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def expand(scales: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """One scale per element of an `[out, in]` matrix."""
    return np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[:shape[0], :shape[1]]


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`w [out, in]` float32 -> (e4m3 values, float32 scales [ceil(out/b0), ceil(in/b1)])."""
    grid = tuple(math.ceil(n / b) for n, b in zip(w.shape, block))
    padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
    padded[:w.shape[0], :w.shape[1]] = np.abs(w)
    amax = padded.reshape(grid[0], block[0], grid[1], block[1]).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    values = (w / expand(scales, w.shape, block)).astype(ml_dtypes.float8_e4m3fn)
    return values, scales


def dequantize(values: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    return values.astype(np.float32) * expand(scales, values.shape, block)


def fp8_tensors(tensors: dict[str, np.ndarray], block: tuple[int, int]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with every `is_quantized` weight as e4m3 + `weight_scale_inv`."""
    out = {}
    for name, w in tensors.items():
        if is_quantized(name):
            out[name], out[name + "_scale_inv"] = quantize(w, block)
        else:
            out[name] = w
    return out


def dequantized_tensors(fp8: dict[str, np.ndarray], block: tuple[int, int]) -> dict[str, np.ndarray]:
    """The plain float32 checkpoint holding exactly the FP8 checkpoint's numbers."""
    return {name: dequantize(w, fp8[name + "_scale_inv"], block) if name + "_scale_inv" in fp8 else w
            for name, w in fp8.items() if not name.endswith("_scale_inv")}


def quant_config(block: tuple[int, int], **overrides) -> dict:
    out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": list(block), "modules_to_not_convert": NOT_CONVERT}
    out.update(overrides)
    return out


def write(path, cfg: ModelConfig, tensors: dict[str, np.ndarray], quantization: dict | None = None) -> str:
    """A single-file checkpoint dir; config.json gets `quantization_config` when given."""
    os.makedirs(path, exist_ok=True)
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if quantization is not None:
        cfg = cfg.replace(extra=tuple(sorted(dict(cfg.extra, quantization_config=quantization).items())))
    cfg.save_json(os.path.join(path, "config.json"))
    return os.fspath(path)
