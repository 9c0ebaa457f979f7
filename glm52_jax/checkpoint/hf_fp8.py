"""HF FP8 checkpoints (block-scaled float8_e4m3fn weights) read into `model.fp8.Fp8Weight`s.

config.json: `quantization_config = {quant_method: "fp8", fmt: "e4m3", weight_block_size: [b0, b1], ...}`
(DeepSeek-V3 / GLM-5 FP8). A quantized linear `X.weight [out, in]` is stored float8_e4m3fn with
`X.weight_scale_inv [ceil(out/b0), ceil(in/b1)]` float32: element = e4m3 value x the scale of its block.
Which modules are quantized is what the checkpoint holds: a weight with a scale is, one without is not (and
one the config's `modules_to_not_convert` names must not be). The embedding, lm_head, norms and router stay
in their stored dtype here (a scale on one of them is refused), as do the indexer's norm and the correction
bias; every other matrix may be FP8. All layers of one of our stacked parameters (and all experts of a
layer) must agree, since one `Fp8Weight` holds them.

Our layouts reshape and split HF's matrices (`checkpoint/hf.py`: q_b `[H*E, Q] -> [Q, H, E]`, kv_b ->
W_UK `[C, H, n]` + W_UV `[C, H, v]`, o_proj `[D, H*V] -> [H, V, D]`), so each of our dims is a run of one HF
dim (`_Layout`: which HF dim, with what stride, at what offset), and the scales follow: per dim of ours a
block on which HF's block is constant (`_our_block`) and, for each of our blocks, the HF scale of its first
element (`_our_scales`). For a dim split into heads of size E with HF block b: 1 head x b when E and the
offset are multiples of b; b/E heads x E when E divides b; else one scale per element of those dims (GLM-5.2's
kv_b: 448 rows per head, so W_UK / W_UV get [C/128, H, n] scales, still 1/32 of the weight's bytes).

Writing (`quantize_hf`, used by `checkpoint.hf.save_pretrained(..., quantization=...)` for a merged FP8 export):
an HF `[out, in]` float32 matrix back to e4m3 + `weight_scale_inv` with the release's rule, per block
scale = amax / 448 (e4m3's largest finite value; 1 for an all-zero block), value = round-to-nearest(w / scale).

A float checkpoint can be read as if it were the FP8 release (`model.base_weights="fp8"`): `QuantizedView`
serves each weight the release quantizes (`quantizes`: the projection matrices, less `RELEASE.not_convert`) as
e4m3 values plus `weight_scale_inv`, quantized per HF tensor in HF's layout by the release rule (`quantize_hf`),
and the loader reads it through the same FP8 path as a real FP8 checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from glm52_jax.config import ModelConfig
from glm52_jax.model import fp8
from glm52_jax.parallel.placement import sharding_for

SCALE_SUFFIX = "_scale_inv"  # after the weight's name: `X.weight_scale_inv`
QUANT_KEY = "quantization_config"
# The HF modules whose weight may be FP8 here: every matrix our model uses through `layers.project` or the
# routed experts (`mlp.gate` is the router: it stays float32).
_QUANTIZABLE = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|wq_b|wk|weights_proj|"
                          r"gate_proj|up_proj|down_proj)\.weight$")
_F8 = ("F8_E4M3", "F8_E5M2")
_FLOAT = ("F32", "BF16", "F16", "F64")


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """The checkpoint's `quantization_config`: `block` = weight_block_size (rows, columns of HF's [out, in]).
    `only` (ours, never in a checkpoint): when set, a module is quantized only if one of these is a substring of its
    name (`EXPERTS`)."""

    block: tuple[int, int]
    not_convert: tuple[str, ...] = ()
    only: tuple[str, ...] = ()

    def skips(self, module: str) -> bool:
        """Whether `modules_to_not_convert` names `module` (HF's rule: an entry that is a substring of it), or
        `only` leaves it out."""
        return any(entry in module for entry in self.not_convert) or (
            bool(self.only) and not any(entry in module for entry in self.only))


# What an FP8 release of GLM-5 / DeepSeek-V3 quantizes, and how: 128 x 128 blocks on every projection matrix
# except the indexer's weights_proj, which DeepSeek-V3.2 keeps unquantized (`modules_to_not_convert`).
RELEASE = Fp8Config((128, 128), ("indexer.weights_proj",))
# The routed experts alone, as the release quantizes them (`model.expert_dtype="fp8"` on a float base: the kernels FP8
# experts multiply, quantized once as read instead of in every call; the shared expert and the rest stay float).
EXPERTS = Fp8Config((128, 128), ("indexer.weights_proj",), only=(".mlp.experts.",))


def quantizes(name: str, quant: Fp8Config) -> bool:
    """Whether quantizing a float model as `quant` says makes HF weight `name` FP8: a projection matrix
    (`_QUANTIZABLE`) whose module `quant.not_convert` does not name."""
    return bool(_QUANTIZABLE.search(name)) and not quant.skips(name[:-len(".weight")])


def split_quantization(cfg: ModelConfig) -> tuple[Fp8Config | None, ModelConfig]:
    """(the FP8 settings of config.json's `quantization_config`, or None; `cfg` without that key: the model
    runs the dequantized weights, and what it saves is not FP8)."""
    extra = dict(cfg.extra)
    raw = extra.pop(QUANT_KEY, None)
    if raw is None:
        return None, cfg
    where = f"config.json {QUANT_KEY}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {raw!r}")
    if raw.get("quant_method") != "fp8":
        raise ValueError(f"{where}.quant_method: only 'fp8' is supported, got {raw.get('quant_method')!r}")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}.fmt: only 'e4m3' is supported, got {raw.get('fmt')!r}")
    block = raw.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{where}.weight_block_size: expected two positive integers (e.g. [128, 128]), got {block!r}")
    not_convert = raw.get("modules_to_not_convert") or ()
    if not isinstance(not_convert, (list, tuple)) or not all(isinstance(m, str) for m in not_convert):
        raise ValueError(f"{where}.modules_to_not_convert: expected a list of module names, got {not_convert!r}")
    return Fp8Config(tuple(block), tuple(not_convert)), dataclasses.replace(cfg, extra=tuple(sorted(extra.items())))


def check_scales(path: str, info: Callable, scales: set[str], expected: dict[str, tuple[int, ...]],
                 quant: Fp8Config | None) -> set[str]:
    """Validates every `*_scale_inv` tensor against its weight from the headers (`info(name)`: dtype, shape)
    and returns the names of the quantized weights. One line naming the tensor for: a scale without a
    quantization_config, or of a tensor that is not an expected weight, or of one kept in its stored dtype here
    or listed in `modules_to_not_convert`; a quantized weight that is not float8_e4m3fn; a scale of the wrong
    dtype or of a grid other than weight_block_size's; an FP8 weight without its scale."""
    quantized = set()
    for scale in sorted(scales):
        weight = scale[:-len(SCALE_SUFFIX)]
        if quant is None:
            raise ValueError(f"{path}: tensor {scale!r} is an FP8 block scale, but config.json has no {QUANT_KEY}")
        if weight in expected and not weight.endswith(".weight"):
            raise ValueError(f"{path}: tensor {scale!r}: FP8 fused expert tensors are not supported "
                             f"(per-expert `mlp.experts.N.*.weight` are)")
        if weight not in expected:
            raise ValueError(f"{path}: tensor {scale!r} scales no weight of this model ({weight!r})")
        if not _QUANTIZABLE.search(weight):
            raise ValueError(f"{path}: tensor {weight!r} is FP8, but this module is kept in its stored dtype "
                             f"(only the projection matrices may be FP8)")
        module = weight[:-len(".weight")]
        if quant.skips(module):
            raise ValueError(f"{path}: tensor {scale!r}: module {module!r} is listed in "
                             f"{QUANT_KEY}.modules_to_not_convert but has a block scale")
        w, s = info(weight), info(scale)
        if w.dtype != "F8_E4M3":
            raise ValueError(f"{path}: tensor {weight!r} has a block scale but dtype {w.dtype}; expected F8_E4M3")
        if s.dtype != "F32":
            raise ValueError(f"{path}: tensor {scale!r} has dtype {s.dtype}; expected F32")
        grid = tuple(math.ceil(n / b) for n, b in zip(expected[weight], quant.block))
        if tuple(s.shape) != grid:
            raise ValueError(f"{path}: tensor {scale!r} has shape {tuple(s.shape)}, but {weight!r} "
                             f"{expected[weight]} in weight_block_size {list(quant.block)} blocks needs {grid}")
        quantized.add(weight)
    for name in sorted(set(expected) - quantized):
        if info(name).dtype in _F8:
            raise ValueError(f"{path}: tensor {name!r} is {info(name).dtype} but has no {name + SCALE_SUFFIX!r}")
    return quantized


def with_quantization(cfg: ModelConfig, raw: dict | None) -> ModelConfig:
    """`cfg` with config.json's `quantization_config` set to `raw` (checked as the loader checks it), or, with
    None, without one."""
    extra = {k: v for k, v in cfg.extra if k != QUANT_KEY}
    if raw is not None:
        extra[QUANT_KEY] = raw
    out = dataclasses.replace(cfg, extra=tuple(sorted(extra.items())))
    split_quantization(out)  # a malformed one fails here, naming the field
    return out


def quantize_hf(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """An HF `[out, in]` matrix (float32) -> (float8_e4m3fn values [out, in], float32 `weight_scale_inv`
    [ceil(out/b0), ceil(in/b1)]): each block's scale is its amax / 448 (1 when the block is all zeros:
    `block_scales`), each value `w / scale` rounded to the nearest e4m3, so `value x scale` is the block's numbers
    to e4m3's precision."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or not np.isfinite(w).all():
        raise ValueError(f"quantize: expected a finite [out, in] matrix, got shape {w.shape}")
    scales = block_scales(w, block)
    per_element = scales[np.arange(w.shape[0])[:, None] // block[0], np.arange(w.shape[1])[None, :] // block[1]]
    return (w / per_element).astype(fp8.E4M3), scales


def block_scales(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`w [out, in]` -> float32 [ceil(out/b0), ceil(in/b1)]: each block's amax / 448 (IEEE float32 division, as
    the release's converter), 1 for an all-zero block (its values are all 0 whatever the scale)."""
    a = np.abs(np.asarray(w, np.float32))
    amax = np.maximum.reduceat(np.maximum.reduceat(a, np.arange(0, a.shape[0], block[0]), axis=0),
                               np.arange(0, a.shape[1], block[1]), axis=1)
    return np.where(amax > 0, amax / np.float32(fp8.E4M3_MAX), np.float32(1.0)).astype(np.float32)


def all_or_none(key: tuple, sources: list[str], quantized: set[str]) -> bool:
    """Whether our parameter `key`, read from the HF weights `sources` (every layer of its stack, every expert),
    is FP8; refuses a mix (one `Fp8Weight` holds them all)."""
    held = [name in quantized for name in sources]
    if any(held) and not all(held):
        fp8_name, plain = sources[held.index(True)], sources[held.index(False)]
        raise ValueError(f"tensor {plain!r} is not FP8 but {fp8_name!r} is, and both are parts of our "
                         f"{'/'.join(map(str, key))}: quantize all of them or none")
    return bool(held) and all(held)


# ------------------------------------------------------------------------------------------------
# A float checkpoint quantized as it is read.


@dataclasses.dataclass(frozen=True)
class _Header:
    """What `_Checkpoint.info` tells of a tensor (the loader's checks read dtype and shape only)."""

    dtype: str
    shape: tuple[int, ...]


class QuantizedView:
    """A float checkpoint (`hf._Checkpoint`) read as its FP8 release: each of `names` (HF [out, in] weights) is
    served as float8_e4m3fn values plus `name_scale_inv` [ceil(out/b0), ceil(in/b1)] float32 (`quantize_hf`
    with `block`), in `names()`, `info` and `get` alike; every other tensor as stored.

    The loader reads all of a parameter's values, then its scales, each device's callback its own slices: a
    tensor's scales are kept when its values are quantized (1/(b0 x b1) of its elements; what the devices will
    hold anyway), so they are never computed twice, and the last quantized values are kept for the next
    device's read of the same tensor."""

    def __init__(self, ckpt, names, block: tuple[int, int]):
        self.path, self._ckpt, self.block = ckpt.path, ckpt, tuple(block)
        self._names = {n for n in names if ckpt.info(n).dtype in _FLOAT}  # anything else: the loader refuses it
        self._scales: dict[str, np.ndarray] = {}
        self._last: tuple[str, np.ndarray] | None = None

    def names(self) -> set[str]:
        return self._ckpt.names() | {n + SCALE_SUFFIX for n in self._names}

    def info(self, name):
        if name in self._names:
            return _Header("F8_E4M3", tuple(self._ckpt.info(name).shape))
        if name.endswith(SCALE_SUFFIX) and (weight := name[:-len(SCALE_SUFFIX)]) in self._names:
            shape = self._ckpt.info(weight).shape
            return _Header("F32", tuple(math.ceil(n / b) for n, b in zip(shape, self.block)))
        return self._ckpt.info(name)

    def get(self, name) -> np.ndarray:
        if name in self._names:
            if self._last is None or self._last[0] != name:
                values, self._scales[name] = quantize_hf(self._ckpt.get(name), self.block)
                self._last = (name, values)
            return self._last[1]
        if name.endswith(SCALE_SUFFIX) and (weight := name[:-len(SCALE_SUFFIX)]) in self._names:
            if weight not in self._scales:
                self._scales[weight] = block_scales(self._ckpt.get(weight), self.block)
            return self._scales[weight]
        return self._ckpt.get(name)


# ------------------------------------------------------------------------------------------------
# Scales in our layout.


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Our per-layer dims of one parameter as runs of HF's [out, in]: per dim (HF dim 0/1, stride), and the
    offset into each HF dim (W_UV starts n rows into each head of kv_b)."""

    dims: tuple[tuple[int, int], ...]
    offset: tuple[int, int] = (0, 0)


def _layout(cfg: ModelConfig, name: str) -> _Layout:
    n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    split_out = {"q_b_proj": (n + r, 0), "wq_b": (cfg.index_head_dim, 0), "w_uk": (n + v, 0), "w_uv": (n + v, n)}
    if name in split_out:  # [in, heads, size] from HF [heads * stride (+ offset), in]
        stride, offset = split_out[name]
        return _Layout(((1, 1), (0, stride), (0, 1)), (offset, 0))
    if name == "o_proj":  # [heads, v, out] from HF [out, heads * v]
        return _Layout(((1, v), (1, 1), (0, 1)))
    return _Layout(((1, 1), (0, 1)))  # [in, out] from HF [out, in]


def _our_block(layout: _Layout, shape: tuple[int, ...], hf_block: tuple[int, int]) -> tuple[int, ...]:
    """Per dim of ours (per-layer `shape`), a block size on which HF's block (hence the scale) is constant."""
    out = []
    for i, (axis, _) in enumerate(layout.dims):
        b = hf_block[axis]
        runs = [j for j, (a, _) in enumerate(layout.dims) if a == axis]
        if len(runs) == 1:
            out.append(b)
            continue
        outer, inner = runs  # outer: heads (stride = the head's row count in HF); inner: within a head
        head_stride, offset, size = layout.dims[outer][1], layout.offset[axis], shape[inner]
        if head_stride % b == 0 and offset % b == 0:
            out.append(1 if i == outer else b)
        elif b % head_stride == 0 and offset == 0 and size == head_stride:
            out.append(b // head_stride if i == outer else size)
        else:
            out.append(1)
    return tuple(out)


def _our_scales(layout: _Layout, block: tuple[int, ...], shape: tuple[int, ...], hf_block: tuple[int, int],
                hf_scales: np.ndarray) -> np.ndarray:
    """HF's scale grid -> ours: for each of our blocks, the HF scale of its first element."""
    starts = np.meshgrid(*[np.arange(0, n, b) for n, b in zip(shape, block)], indexing="ij", sparse=True)
    index = [layout.offset[axis] + sum(s * starts[i] for i, (a, s) in enumerate(layout.dims) if a == axis)
             for axis in (0, 1)]
    return np.asarray(hf_scales, np.float32)[index[0] // hf_block[0], index[1] // hf_block[1]]


@dataclasses.dataclass(frozen=True)
class Fp8Param:
    """How one of our parameters is read from an FP8 checkpoint: its scale grid and HF -> our scales."""

    block: tuple[int, ...]
    scale_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]  # HF scale grid of one layer (or expert) -> ours


def fp8_param(cfg: ModelConfig, quant: Fp8Config, key: tuple, shape: tuple[int, ...]) -> Fp8Param:
    """`key` (`('stacks', s, 'layers', slot, ...)`, of `shape`: [layers, (experts,) ...]) as an FP8 parameter."""
    lead = 2 if key[-1] in ("w_gate", "w_up", "w_down") else 1
    layer_shape = tuple(shape[lead:])
    layout = _layout(cfg, key[-1])
    block = _our_block(layout, layer_shape, quant.block)

    def to_ours(hf_scales):
        return _our_scales(layout, block, layer_shape, quant.block, hf_scales)
    return Fp8Param(block, fp8.scale_shape(tuple(shape), block), to_ours)


def fp8_struct(param: Fp8Param, shape: tuple[int, ...], dtype) -> fp8.Fp8Weight:
    """The `Fp8Weight` of one parameter of `shape` as ShapeDtypeStructs (e4m3 values, float32 scales), unsharded:
    what `materialize` builds, and plan mode's abstract model holds."""
    return fp8.Fp8Weight(jax.ShapeDtypeStruct(tuple(shape), fp8.E4M3),
                         jax.ShapeDtypeStruct(tuple(param.scale_shape), jnp.float32), param.block, jnp.dtype(dtype))


def materialize(read_values: Callable, read_scales: Callable, param: Fp8Param, shape: tuple[int, ...], dtype,
                var, mesh) -> fp8.Fp8Weight:
    """The `Fp8Weight` of one parameter: e4m3 values (`read_values(index)`, our layout) and float32 scales
    (`read_scales(index)` on the scale grid), on the default device or, with a mesh, each device reading its
    own slices (`placement.sharding_for`: values like the weight, scales by its unblocked logical axes)."""
    def values(index):
        return np.asarray(read_values(index)).astype(fp8.E4M3, copy=False)

    def scales(index):
        return np.asarray(read_scales(index), np.float32)

    if mesh is None:
        whole = (tuple(slice(None) for _ in shape), tuple(slice(None) for _ in param.scale_shape))
        return fp8.Fp8Weight(jnp.asarray(values(whole[0])), jnp.asarray(scales(whole[1])), param.block, dtype)
    target = sharding_for(var.replace(fp8_struct(param, shape, dtype)), mesh)
    return fp8.Fp8Weight(jax.make_array_from_callback(shape, target.values, values),
                         jax.make_array_from_callback(param.scale_shape, target.scales, scales), param.block, dtype)
