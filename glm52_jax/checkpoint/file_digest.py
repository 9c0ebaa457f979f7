"""The digest of a safetensors file's values (`host_digest.combined_digest` over its tensors, names as its keys):
what `verify` compares with a receipt's on-device LoRA digests. numpy only (the verifier starts without JAX)."""

from __future__ import annotations

import os

from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.host_digest import array_digest, combined_digest, hex_digest


def file_digest(path: str | os.PathLike) -> str:
    """`combined_digest` of the file's tensors, read one tensor at a time (memory-mapped)."""
    f = SafetensorsFile(path)
    return combined_digest((name, f.tensors[name].shape, str(f.get(name).dtype), hex_digest(array_digest(f.get(name))))
                           for name in f.keys())
