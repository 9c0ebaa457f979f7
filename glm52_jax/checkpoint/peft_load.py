"""Read a PEFT adapter back into a model's LoRA adapters: the exact inverse of `peft.save_peft_adapter`.

    model = load_peft_adapter(model, "RUN/export/step_1/peft")   # same base, adapters from the files

The adapter directory holds `adapter_config.json` and `adapter_model.safetensors` as `save_peft_adapter`
writes them. `check_peft_adapter` compares both with what exporting the model would write, before any
tensor data is read: the config's rank, alpha, target modules / parameters (the LoRA families) and
patterns, then the tensor names and every shape. Any difference is one line naming the file and the
mismatch (`AdapterMismatchError`). The model may be abstract (`nnx.eval_shape`), so a run can check its
adapter before building the model.

Loading reads each tensor pair and applies its entry's inverse (`peft._Entry.unpack`: transposes,
reshapes, the kv_b split, the experts' expert-major / expert-minor layouts and the fused gate_up block
diagonal), so save -> load gives the LoRA state back bit for bit (values cast to the adapters' dtype,
a no-op for files the same run wrote).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax.checkpoint.peft import _PREFIX, ADAPTER_CONFIG, ADAPTER_WEIGHTS, _collect, _config
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.model.lora import LoRA

# adapter_config.json keys that decide what the adapters are (others, e.g. base_model_name_or_path, do not).
_CONFIG_KEYS = ("peft_type", "r", "lora_alpha", "target_modules", "target_parameters", "rank_pattern",
                "alpha_pattern", "use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "layers_to_transform")


class AdapterMismatchError(ValueError):
    """The adapter files do not fit the model's LoRA (one line naming the file and what differs)."""


def _same(got, want) -> bool:
    if isinstance(want, list) or isinstance(got, list):  # target lists: order does not matter; None = none
        return sorted(got or []) == sorted(want or [])
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and float(got) == float(want)
    return got == want


def _describe(key: str, got, want) -> str:
    if isinstance(want, list) or isinstance(got, list):
        extra, missing = sorted(set(got or []) - set(want or [])), sorted(set(want or []) - set(got or []))
        parts = ([f"has {extra} the run does not adapt"] if extra else []) + \
            ([f"lacks {missing} the run adapts"] if missing else [])
        return f"{key} " + " and ".join(parts) + " (model.lora_families differ)"
    return f"{key} is {got!r}, the run's LoRA needs {want!r}"


def check_peft_adapter(model, path: str | os.PathLike):
    """(the model's export entries, the weights file) after checking `path`'s config, tensor names and shapes
    against `model`'s LoRA (a real or an abstract model). Raises AdapterMismatchError on any difference."""
    path = Path(path)
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterMismatchError(f"{f}: no such file (expected a PEFT adapter directory, as --mode=export "
                                       "writes under peft/)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterMismatchError(f"{config_file}: not a JSON adapter config ({e})") from None
    if not isinstance(config, dict):
        raise AdapterMismatchError(f"{config_file}: not a JSON object")
    entries, modules, params, routed = _collect(model)
    want = _config(model.opts.lora, modules, params, routed, "")
    for key in _CONFIG_KEYS:
        if not _same(config.get(key), want[key]):
            raise AdapterMismatchError(f"{config_file}: {_describe(key, config.get(key), want[key])}")
    try:
        weights = SafetensorsFile(weights_file)
    except (OSError, ValueError, KeyError) as e:
        raise AdapterMismatchError(f"{weights_file}: unreadable ({e})") from None
    shapes = {}
    for entry in entries:
        shapes[f"{_PREFIX}{entry.module}.lora_A.weight"] = tuple(entry.lora_a.shape)
        shapes[f"{_PREFIX}{entry.module}.lora_B.weight"] = tuple(entry.lora_b.shape)
    missing = [n for n in shapes if n not in weights.tensors]
    if missing:
        raise AdapterMismatchError(f"{weights_file}: lacks tensor {missing[0]}"
                                   + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    extra = sorted(set(weights.tensors) - set(shapes))
    if extra:
        raise AdapterMismatchError(f"{weights_file}: has tensor {extra[0]} the model has no adapter for"
                                   + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for name, shape in shapes.items():
        info = weights.tensors[name]
        if info.shape != shape:
            raise AdapterMismatchError(f"{weights_file}: tensor {name} has shape {list(info.shape)}, the model's "
                                       f"adapter needs {list(shape)}")
    return entries, weights


def load_peft_adapter(model, path: str | os.PathLike):
    """`model` (same base arrays, not copied) with its LoRA adapters read from the PEFT adapter at `path`."""
    entries, weights = check_peft_adapter(model, path)
    graphdef, lora, rest = nnx.split(model, LoRA, ...)
    flat = dict(nnx.to_flat_state(lora))
    values = {p: np.empty(v.get_value().shape, v.get_value().dtype) for p, v in flat.items()}
    filled: dict[tuple, set] = {p: set() for p in flat}
    for entry in entries:
        names = (f"{_PREFIX}{entry.module}.lora_A.weight", f"{_PREFIX}{entry.module}.lora_B.weight")
        try:
            parts = entry.unpack(*(np.asarray(weights.get(n)) for n in names))
        except ValueError as e:
            raise AdapterMismatchError(f"{weights.path}: {e}") from None
        for var_path, rep, value in parts:
            target = values[var_path] if rep is None else values[var_path][rep]
            if value.shape != target.shape:  # an export bug, not bad input: shapes were checked above
                raise AssertionError(f"peft_load: {var_path} layer {rep}: {value.shape} vs {target.shape}")
            target[...] = value
            filled[var_path].add(rep)
    for var_path, reps in filled.items():  # every adapter array, every layer of its stack, written once
        want = {None} if reps == {None} else set(range(values[var_path].shape[0]))
        if not reps or reps != want:
            raise AssertionError(f"peft_load: adapter array {'/'.join(map(str, var_path))} not fully read")
    new = [(p, v.replace(jnp.asarray(values[p], v.get_value().dtype))) for p, v in flat.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(new), rest)
