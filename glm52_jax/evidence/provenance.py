"""Provenance: which code, which repository state and which library versions produced a run.

Also owns the canonical JSON encoding that every hash in an evidence receipt is taken over:
sorted keys, no whitespace, ASCII only, standard JSON only (NaN/inf rejected with the key path).
Nothing here imports jax: package versions come from `importlib.metadata`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "canonical_json", "canonical_sha256", "check_json", "collect_provenance", "config_hash",
           "git_info", "package_root", "package_versions", "source_digest", "source_files"]

# Distributions whose versions are recorded (importlib.metadata names).
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes", "tokenizers")
SOURCE_SUFFIXES = (".py", ".json", ".jsonl")
_GIT_TIMEOUT_S = 20


def check_json(obj: Any, where: str = "$") -> None:
    """Raise if `obj` is not plain, finite JSON data; the message names the offending key path.

    Allowed: dict with str keys, list, tuple, str, int, finite float, bool, None. Anything else
    (NaN/inf, numpy scalars, sets, ...) is refused, so that canonical JSON is standard JSON and a
    receipt re-read from disk hashes to the same value.
    """
    if obj is None or isinstance(obj, (str, bool, int)):
        return
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"{where}: non-finite float {obj!r} is not valid JSON; record it as a string or flag")
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: dict key {key!r} is {type(key).__name__}, expected str")
            check_json(value, f"{where}.{key}")
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            check_json(value, f"{where}[{i}]")
        return
    raise TypeError(f"{where}: {type(obj).__name__} is not JSON data (convert numpy scalars with .item())")


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: sort_keys, separators (",", ":"), ensure_ascii, finite numbers only."""
    check_json(obj)
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode("ascii")


def canonical_sha256(obj: Any) -> str:
    """sha256 hex digest of `canonical_json(obj)`."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def config_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of a config (a dataclass instance is first turned into a dict)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return canonical_sha256(obj)


def package_root() -> Path:
    """Directory of the installed `glm52_jax` package (found without importing anything)."""
    return Path(__file__).resolve().parent.parent


def source_files(root: str | os.PathLike) -> list[str]:
    """Sorted POSIX paths, relative to `root`, of every *.py / *.json / *.jsonl file below it."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"source root {root} is not a directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel_dir = Path(dirpath).relative_to(root)
        found += [(rel_dir / f).as_posix() for f in filenames if f.endswith(SOURCE_SUFFIXES)]
    return sorted(found)


def source_digest(root: str | os.PathLike | None = None) -> str:
    """sha256 over the sorted relative paths and contents of the source files under `root`.

    Defaults to the installed package. Only relative paths and bytes enter the hash (no mtimes,
    no absolute paths), so the same tree gives the same digest on any machine. Each file is framed
    as path, NUL, byte length, NUL, content, so no two different trees can produce the same stream.
    """
    root = Path(root) if root is not None else package_root()
    h = hashlib.sha256()
    for rel in source_files(root):
        content = (root / rel).read_bytes()
        h.update(rel.encode("utf-8") + b"\0" + str(len(content)).encode("ascii") + b"\0")
        h.update(content)
    return h.hexdigest()


def _git(directory: Path, *args: str) -> str | None:
    # Inherited GIT_DIR & co would point git at some other repository than `directory`'s.
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    try:
        proc = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True,
                              timeout=_GIT_TIMEOUT_S, env=env, check=False)
    except (OSError, subprocess.SubprocessError):  # git missing, not executable, hung
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_info(directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """`{"commit": hex | None, "dirty": bool | None}` for the git checkout containing `directory`.

    Defaults to the package directory. Both values are None outside a git checkout or without git;
    `commit` is None in a repository with no commits yet. Untracked files count as dirty.
    """
    directory = Path(directory) if directory is not None else package_root()
    if _git(directory, "rev-parse", "--is-inside-work-tree") is None:
        return {"commit": None, "dirty": None}
    head = _git(directory, "rev-parse", "--verify", "--quiet", "HEAD")
    status = _git(directory, "status", "--porcelain", "--untracked-files=normal")
    return {"commit": head.strip() if head else None, "dirty": None if status is None else bool(status.strip())}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the libraries a run depends on (None if absent), plus python/platform."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    versions["platform"] = platform.platform()
    return versions


def collect_provenance(root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Everything above in one JSON-ready dict: source digest and file count, git state, versions."""
    root = Path(root) if root is not None else package_root()
    return {
        "source_sha256": source_digest(root),
        "source_files": len(source_files(root)),
        "git": git_info(root),
        "packages": package_versions(),
    }
