"""A run's starting LoRA (`model.init_adapter`): a PEFT adapter directory or a Megatron LoRA state dict file.

    check_init_adapter(abstract_model, path)   # before any model is built: names, shapes, rank; one-line errors
    model = load_init_adapter(model, path)     # the same base, adapters from the files (bit for bit)

  DIR                a PEFT adapter (adapter_config.json + adapter_model.safetensors), as --mode=export writes
                     under peft/ (checkpoint/peft_load.py)
  FILE.safetensors   a Megatron LoRA state dict: Megatron-Bridge CanonicalLoRA names (`<module>.adapter.linear_in
                     .weight`, ...), grouped or sequential experts (checkpoint/megatron.py, its exact inverse)
  any other FILE     the same as a torch file (`torch.save` of the dict, optionally under "model"), read only with
                     `torch.load(weights_only=True)`: a pickle that would build anything but tensors is refused

A Megatron state dict holds the adapters' tensors, not Megatron-Bridge's PEFT settings: the rank is read from
the tensors (it must be the run's `model.lora_rank`), the adapters present must be exactly the run's
`model.lora_families`, and the scale is the run's alpha / rank (Megatron's `alpha / dim` with the run's
`model.lora_alpha` as Bridge's alpha).

Axis letters: E experts, r rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax.checkpoint.megatron import MegatronLayout, load_megatron_state, lora_from_megatron, megatron_shapes
from glm52_jax.checkpoint.peft import ADAPTER_WEIGHTS
from glm52_jax.checkpoint.peft_load import AdapterMismatchError, check_peft_adapter, load_peft_adapter
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.model.lora import LoRA

_ADAPTER = ".adapter."
_EXTRA_STATE = "._extra_state"


def _more(names: list[str]) -> str:
    return f"{names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def _file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Megatron state dict file (a safetensors header, or the loaded torch file)."""
    try:
        if path.suffix == ".safetensors":
            f = SafetensorsFile(path)
            return {k: tuple(info.shape) for k, info in f.tensors.items() if not k.endswith(_EXTRA_STATE)}
        return {k: tuple(v.shape) for k, v in load_megatron_state(path).items()}
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AdapterMismatchError(f"{path}: not a readable Megatron LoRA state dict ({first})") from None


def check_megatron_lora(model, path: str | os.PathLike) -> MegatronLayout:
    """The layout of the Megatron LoRA state dict at `path` after checking its names, rank and shapes against
    `model`'s LoRA (real or abstract). Raises AdapterMismatchError naming the problem and the fix."""
    path = Path(path)
    shapes = _file_shapes(path)
    if not shapes:
        raise AdapterMismatchError(f"{path}: holds no tensors (expected a Megatron LoRA state dict)")
    base = sorted(k for k in shapes if _ADAPTER not in k)
    if base:
        raise AdapterMismatchError(f"{path}: holds tensors that are no LoRA adapter ({_more(base)}): pass a state "
                                   "dict of the adapters only (Megatron-Bridge names, `<module>.adapter.linear_in"
                                   ".weight`)")
    fused = sorted(k for k in shapes if ".linear_fc1.adapter.linear_" in k)
    if fused:
        raise AdapterMismatchError(f"{path}: {fused[0]} is a plain-LoRA adapter on the fused linear_fc1 (one A "
                                   "shared by gate and up), which our separate gate / up adapters cannot hold; "
                                   "train with Megatron-Bridge's CanonicalLoRA")
    ranks = sorted({s[-2] for k, s in shapes.items() if k.endswith(".linear_in.weight") and len(s) >= 2})
    want_rank = model.opts.lora.rank
    if ranks != [want_rank]:
        raise AdapterMismatchError(f"{path}: the adapters' rank is {', '.join(map(str, ranks)) or 'unreadable'}, "
                                   f"the run's LoRA needs {want_rank} (set --config.model.lora_rank)")
    layout = MegatronLayout.detect(shapes)
    expected = megatron_shapes(model, layout, base=False)
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    families = ",".join(sorted(model.opts.lora.families))
    if extra:
        raise AdapterMismatchError(f"{path}: has adapters the run does not train ({_more(extra)}; "
                                   f"--config.model.lora_families={families})")
    if missing:
        raise AdapterMismatchError(f"{path}: lacks adapters the run trains ({_more(missing)}; "
                                   f"--config.model.lora_families={families})")
    for name, shape in expected.items():
        if shapes[name] != tuple(shape):
            raise AdapterMismatchError(f"{path}: tensor {name} has shape {list(shapes[name])}, the model's adapter "
                                       f"needs {list(shape)}")
    return layout


def load_megatron_lora(model, path: str | os.PathLike):
    """`model` (same base arrays, not copied) with its LoRA adapters read from a Megatron LoRA state dict file."""
    layout = check_megatron_lora(model, path)
    lora = lora_from_megatron(load_megatron_state(path), model, layout)
    graphdef, _, rest = nnx.split(model, LoRA, ...)
    lora = nnx.from_flat_state([(p, v.replace(jnp.asarray(np.asarray(v.get_value()))))
                                for p, v in nnx.to_flat_state(lora)])
    return nnx.merge(graphdef, lora, rest)


def _missing(path: Path) -> AdapterMismatchError:
    return AdapterMismatchError(f"{path}: no such file or directory (expected a PEFT adapter directory, as "
                                "--mode=export writes under peft/, or a Megatron LoRA state dict file)")


def check_init_adapter(model, path: str | os.PathLike) -> Path:
    """Checks `path` (PEFT directory or Megatron file) against `model`'s LoRA; returns the file its hash names."""
    path = Path(path)
    if path.is_dir():
        check_peft_adapter(model, path)
        return path / ADAPTER_WEIGHTS
    if not path.is_file():
        raise _missing(path)
    check_megatron_lora(model, path)
    return path


def load_init_adapter(model, path: str | os.PathLike):
    """`model` with its adapters read from `path` (PEFT directory or Megatron LoRA file)."""
    path = Path(path)
    if path.is_dir():
        return load_peft_adapter(model, path)
    if not path.is_file():
        raise _missing(path)
    return load_megatron_lora(model, path)
