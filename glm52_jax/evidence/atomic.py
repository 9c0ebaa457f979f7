"""Atomic file writes: a reader sees either the old file or the complete new one, never a part.

Each write goes to a temporary file in the destination's own directory (so the final rename never
crosses a filesystem), is fsynced, and then renamed over the destination. If anything fails before
the rename, the temporary file is removed and the destination is untouched. With
`overwrite=False` the rename is a hard link instead, which fails if the destination exists, so
two writers can never clobber each other's committed file.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_text"]

# mkstemp creates files 0600; evidence is meant to be read by others, like a plain `open` would allow.
_FILE_MODE = 0o644


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Iterable[bytes], *, overwrite: bool = True) -> int:
    """Write `data` (bytes, or an iterable of byte chunks) to `path` atomically; return bytes written.

    A chunk iterable that raises part-way leaves `path` as it was and no temporary file behind.
    With `overwrite=False`, raises FileExistsError if `path` exists (checked atomically at publish).
    """
    path = Path(path)
    if not overwrite and path.exists():
        # Early, friendly check; the hard link below is what actually guarantees no clobbering.
        raise FileExistsError(f"refusing to overwrite existing file {path}")
    chunks = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        written = 0
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _FILE_MODE)
            for chunk in chunks:
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    raise TypeError(f"atomic write to {path}: chunk of type {type(chunk).__name__}, expected bytes")
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path, overwrite)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return written


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8", overwrite: bool = True) -> int:
    """Write `text` to `path` atomically; return bytes written."""
    return atomic_write_bytes(path, text.encode(encoding), overwrite=overwrite)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, overwrite: bool = True, **dump_kwargs: Any) -> int:
    """Serialise `obj` with `json.dumps(**dump_kwargs)` (strict: no NaN/inf) and write it atomically.

    Serialisation happens before any file is created, so an unserialisable object leaves nothing.
    """
    dump_kwargs.setdefault("allow_nan", False)
    text = json.dumps(obj, **dump_kwargs)
    return atomic_write_text(path, text if text.endswith("\n") else text + "\n", overwrite=overwrite)


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails with EEXIST if someone got there first: no overwrite, ever
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise FileExistsError(f"refusing to overwrite existing file {path}") from e
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # Filesystem without hard links: fall back to check-then-rename (a narrow race remains).
        if path.exists():
            raise FileExistsError(f"refusing to overwrite existing file {path}") from e
        os.replace(tmp, path)
        return
    try:  # the file is published under its final name; a leftover second link is only clutter
        tmp.unlink()
    except OSError:
        pass


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform/filesystem allows fsync on a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
