"""The on-device array digest (`checkpoint/digest.py`) recomputed on the host from bytes, and the digest of a
whole state: what `verify` uses to tie a receipt's LoRA digests to the safetensors files it ships.

numpy only (no JAX): the evidence verifier imports this when it checks a digest, so it still starts without JAX.

A state's digest (`combined_digest`) is the sha256 of the canonical JSON list of [name, shape, dtype, array
digest] sorted by name. The array digests do not depend on sharding, device or process count, so neither
does the state's: a 1-device run and an 8-device (or 2-process) run of the same values quote the same
digest, and each process computes it from its own shards (only a [n_arrays, 4] uint32 table leaves the
devices). The same values read from a file give the same digest (`checkpoint.file_digest`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence

import numpy as np

LANES = 4
# Must equal checkpoint/digest.py's (tests/checkpoint/test_state_digest.py compares the two on every dtype).
_SEEDS = np.array([0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F], np.uint32)
_OUTER_SEEDS = np.array([0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09], np.uint32)
INDEX_LIMIT = 1 << 32
CHUNK_ELEMENTS = 1 << 20  # words mixed per numpy step: bounds the temporaries (~16 x 4 MiB), not the array


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _words(x: np.ndarray) -> np.ndarray:
    """The array's bits as a flat uint32 word stream (C order; 8-byte types: two words per element, low first)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.reshape(-1).astype(np.uint32)
    size = x.dtype.itemsize
    if size == 8:
        return x.reshape(-1).view(np.uint32)
    if size not in (1, 2, 4):
        raise TypeError(f"array digest: dtype {x.dtype} ({size} bytes per element) is not supported")
    return x.reshape(-1).view(f"u{size}").astype(np.uint32, copy=False)


def _inner_size(shape: tuple[int, ...]) -> int | None:
    """Elements of the longest run of trailing axes with fewer than 2^32 (the digest's inner index); None when
    the whole array has fewer (then the flat index is the position and there is no outer index)."""
    if math.prod(shape) < INDEX_LIMIT:
        return None
    k = len(shape)
    while k > 0 and math.prod(shape[k - 1:]) < INDEX_LIMIT:
        k -= 1
    return math.prod(shape[k:])


def array_digest(x: np.ndarray) -> np.ndarray:
    """[LANES] uint32: `checkpoint.digest.array_digest` of host array `x`, in chunks of `CHUNK_ELEMENTS` words."""
    x = np.asarray(x)
    words = _words(x)
    word_shape = x.shape + ((2,) if x.dtype.itemsize == 8 else ())
    inner_size = _inner_size(word_shape)
    sums = np.zeros(LANES, np.uint32)
    with np.errstate(over="ignore"):
        for start in range(0, words.size, CHUNK_ELEMENTS):
            chunk = words[start:start + CHUNK_ELEMENTS]
            flat = np.arange(start, start + chunk.size, dtype=np.uint64)
            inner = (flat if inner_size is None else flat % np.uint64(inner_size)).astype(np.uint32)
            for lane in range(LANES):
                mixed = _fmix32(inner + _SEEDS[lane])
                if inner_size is not None:
                    outer = (flat // np.uint64(inner_size)).astype(np.uint32)
                    mixed = _fmix32(mixed ^ _fmix32(outer + _OUTER_SEEDS[lane]))
                sums[lane] += _fmix32(chunk ^ mixed).sum(dtype=np.uint32)
    return sums


def hex_digest(row: Sequence[int]) -> str:
    """A [LANES] uint32 row as 32 hex characters (lane 0 first, each lane big-endian), as the inventory writes it."""
    return "".join(f"{int(word):08x}" for word in row)


def combined_digest(entries: Iterable[tuple[str, Sequence[int], str, str]]) -> str:
    """sha256 of the canonical JSON of [name, shape, dtype, array digest (32 hex)] sorted by name: one state's
    digest, which depends on its names, shapes, dtypes and values, never on where they lived."""
    rows = sorted([str(name), [int(n) for n in shape], str(dtype), str(digest)]
                  for name, shape, dtype, digest in entries)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode("ascii")).hexdigest()
