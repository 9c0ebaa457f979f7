"""An HF checkpoint directory's weight files checked before a run loads them: one line naming the file.

A directory with config.json but no weights, a shard the index names that is missing, a truncated
safetensors file or one with a corrupt header would otherwise fail deep inside the loader with a
traceback, after the run has started. Reads only each file's header (and its size). Imports no JAX.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from glm52_jax.checkpoint.safetensors_io import SafetensorsFile

INDEX_FILE = "model.safetensors.index.json"  # as checkpoint/hf.py names it


class CheckpointFilesError(ValueError):
    """A checkpoint directory whose weight files cannot be loaded."""


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of `directory`: those its index names (each must exist), else every
    `*.safetensors` in it; raises `CheckpointFilesError` when there are none."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointFilesError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise CheckpointFilesError(f"{index} names {len(missing)} missing shard(s): {', '.join(missing[:3])}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointFilesError(f"{directory} has config.json but no *.safetensors weights (nor {INDEX_FILE})")
    return files


def check_weight_files(directory: str | os.PathLike) -> int:
    """Parses every weight file's header and checks each tensor's bytes lie within the file; returns
    the number of tensors. Raises `CheckpointFilesError` (one line naming the file) otherwise."""
    tensors = 0
    for path in weight_files(directory):
        try:
            tensors += len(SafetensorsFile(path).tensors)
        except (ValueError, KeyError, TypeError, OSError) as e:  # the reader's messages name the file
            message = str(e) if str(path) in str(e) else f"{path}: {type(e).__name__}: {e}"
            raise CheckpointFilesError(message.splitlines()[0]) from None
    return tensors
