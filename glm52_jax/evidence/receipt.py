"""Evidence receipts: a run directory holding artifact files and a hash-bound `receipt.json`.

Layout::

    run_dir/
      artifacts/...     files added through EvidenceWriter, each listed in the manifest
      receipt.json      written last, atomically, never overwritten

A receipt may also carry its own name (`EvidenceWriter(run_dir, receipt_name="gradient_parity_32k.json")`,
as the seed names its receipts); its artifacts then live in `run_dir/gradient_parity_32k/` and the
manifest paths start with that directory, so several named receipts can share one `evidence/` directory.

The receipt is a JSON object::

    {"schema": "glm52-jax/evidence", "version": 1, "created_utc": ..., "provenance": {...},
     <caller sections: "prompt", "model", "training", ...>,
     "manifest": [{"path": "artifacts/x.npy", "kind": ..., "bytes": n, "sha256": hex}, ...],
     "manifest_sha256": sha256(canonical JSON of the manifest list),
     "receipt_sha256": sha256(canonical JSON of every other key)}

Because receipt.json appears only after every artifact is complete, a run directory without it is
an aborted transaction, and one with it can be checked end to end by `verify`.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from glm52_jax.evidence.atomic import atomic_write_bytes, atomic_write_json
from glm52_jax.evidence.hashing import sha256_file
from glm52_jax.evidence.provenance import canonical_sha256, check_json, collect_provenance

__all__ = ["ARTIFACTS_DIR", "NONDETERMINISTIC_KEY", "RECEIPT_NAME", "RESERVED_KEYS", "SCHEMA", "VERSION",
           "EvidenceError", "EvidenceWriter", "artifacts_dir_name", "deterministic_view", "load_receipt",
           "receipt_file", "verify"]

SCHEMA = "glm52-jax/evidence"
VERSION = 1
RECEIPT_NAME = "receipt.json"
ARTIFACTS_DIR = "artifacts"
# Caller-set top-level key listing sections (or artifact paths) that legitimately differ between runs.
NONDETERMINISTIC_KEY = "nondeterministic"
RESERVED_KEYS = frozenset({"schema", "version", "created_utc", "provenance", "manifest", "manifest_sha256",
                           "receipt_sha256"})
_ENTRY_KEYS = frozenset({"path", "kind", "bytes", "sha256"})
_CHUNK = 1 << 20


class EvidenceError(ValueError):
    """Invalid evidence input (bad artifact name, bad fields) or an unreadable receipt."""


def _name_problem(name: Any) -> str | None:
    """Why `name` is not a plain relative POSIX path, or None if it is."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if "\\" in name or "\0" in name:
        return "must not contain backslashes or NUL"
    if name.startswith("/"):
        return "must be relative, not absolute"
    parts = name.split("/")
    if ".." in parts:
        return "must not contain '..' (escapes the run directory)"
    if any(p in ("", ".") for p in parts):
        return "must not contain empty or '.' components"
    return None


def artifacts_dir_name(receipt_name: str) -> str:
    """The artifacts directory beside a receipt: `artifacts` for receipt.json, else the receipt's stem."""
    if receipt_name == RECEIPT_NAME:
        return ARTIFACTS_DIR
    plain = "/" not in receipt_name and _name_problem(receipt_name) is None
    if not (plain and receipt_name.endswith(".json") and len(receipt_name) > 5):
        raise EvidenceError(f"receipt name {receipt_name!r} must be a plain file name ending in .json")
    return receipt_name[:-5]


def _read_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class EvidenceWriter:
    """Collects artifacts under `run_dir/artifacts/` and commits them with `receipt.json`.

    Refuses a run directory that already has a receipt (committed evidence is never overwritten)
    or leftover artifact files (from an aborted run: they would be unlisted strays). Provenance
    is captured at construction, i.e. for the code as it was when the transaction started.
    """

    def __init__(self, run_dir: str | os.PathLike, *, provenance: Mapping[str, Any] | None = None,
                 receipt_name: str = RECEIPT_NAME):
        self.run_dir = Path(run_dir)
        self.receipt_path = self.run_dir / receipt_name
        self._artifacts = artifacts_dir_name(receipt_name)
        self.artifacts_dir = self.run_dir / self._artifacts
        if self.receipt_path.exists():
            raise FileExistsError(f"{self.receipt_path} already exists; refusing to overwrite committed evidence "
                                  "(use a new run directory)")
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        leftovers = sorted(p.relative_to(self.run_dir).as_posix() for p in self.artifacts_dir.rglob("*")
                           if not p.is_dir())
        if leftovers:
            raise EvidenceError(f"{self.artifacts_dir} already holds {len(leftovers)} file(s) from an uncommitted "
                                f"run (first: {leftovers[0]}); use a fresh run directory")
        self.provenance = dict(collect_provenance() if provenance is None else provenance)
        check_json(self.provenance, "provenance")
        self._entries: dict[str, dict[str, Any]] = {}
        self._committed = False

    @property
    def manifest(self) -> list[dict[str, Any]]:
        """The entries recorded so far, sorted by path (copies)."""
        return [dict(self._entries[p]) for p in sorted(self._entries)]

    def add_bytes(self, name: str, data: bytes, kind: str) -> dict[str, Any]:
        """Write `data` to `<artifacts dir>/<name>`; return its manifest entry."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"artifact {name!r}: data is {type(data).__name__}, expected bytes")
        return self._add(name, kind, [bytes(data)])

    def add_json(self, name: str, obj: Any, kind: str) -> dict[str, Any]:
        """Write `obj` as deterministic JSON (sorted keys, indent 2, ASCII, finite numbers only)."""
        check_json(obj, f"artifact {name}")
        text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n"
        return self._add(name, kind, [text.encode("ascii")])

    def add_array(self, name: str, array: Any, kind: str) -> dict[str, Any]:
        """Write `array` as a `.npy` file (`np.save`, C order, no pickle: same array, same bytes)."""
        import io

        import numpy as np

        if not name.endswith(".npy"):
            raise EvidenceError(f"artifact {name!r}: arrays are saved as .npy, so the name must end in '.npy'")
        array = np.asarray(array)
        if array.dtype.hasobject:
            raise EvidenceError(f"artifact {name!r}: object arrays cannot be saved without pickle")
        if not array.flags.c_contiguous:  # else np.save would record Fortran order for the same values
            array = array.copy(order="C")
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        return self._add(name, kind, [buf.getvalue()])

    def add_file(self, name: str, path: str | os.PathLike, kind: str) -> dict[str, Any]:
        """Copy the file at `path` to `artifacts/<name>`; the hash is of the bytes actually copied."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"artifact {name!r}: source {path} is not a file")
        return self._add(name, kind, _read_chunks(path))

    def add_written(self, name: str, kind: str) -> dict[str, Any]:
        """List `artifacts/<name>`, written there (atomically, complete) by another process of the run,
        e.g. its trace; the hash is of the file as it is now."""
        return self._add(name, kind, None)

    def _add(self, name: str, kind: str, chunks: Iterable[bytes] | None) -> dict[str, Any]:
        if self._committed:
            raise EvidenceError(f"cannot add artifact {name!r}: the receipt is already committed")
        problem = _name_problem(name)
        if problem:
            raise EvidenceError(f"artifact name {name!r} {problem}")
        if not isinstance(kind, str) or not kind:
            raise EvidenceError(f"artifact {name!r}: kind must be a non-empty string")
        rel = f"{self._artifacts}/{name}"
        if rel in self._entries:
            raise EvidenceError(f"artifact {name!r} was already added")
        for other in self._entries:  # a file cannot also be a directory of another artifact
            if other.startswith(rel + "/") or rel.startswith(other + "/"):
                raise EvidenceError(f"artifact {name!r} conflicts with {other!r} (file vs directory)")
        dest = self.run_dir / rel
        if chunks is None:  # written by another process
            if dest.is_symlink() or not dest.is_file():
                raise EvidenceError(f"artifact {name!r}: {dest} is not a regular file")
            entry = {"path": rel, "kind": kind, "bytes": dest.stat().st_size, "sha256": sha256_file(dest)}
            self._entries[rel] = entry
            return dict(entry)
        dest.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()

        def hashed() -> Iterator[bytes]:
            for chunk in chunks:
                h.update(chunk)
                yield chunk

        size = atomic_write_bytes(dest, hashed(), overwrite=False)
        entry = {"path": rel, "kind": kind, "bytes": size, "sha256": h.hexdigest()}
        self._entries[rel] = entry
        return dict(entry)

    def commit(self, fields: Mapping[str, Any] | None = None) -> Path:
        """Write `receipt.json` (atomically, last) with the caller's sections; return its path.

        `fields` maps section names to plain JSON data; NaN/inf are refused with the key path
        (record non-finite numerics as strings or flags). Reserved keys cannot be set.
        """
        if self._committed:
            raise EvidenceError(f"{self.receipt_path} was already committed by this writer")
        fields = dict(fields or {})
        for key in fields:
            if not isinstance(key, str):
                raise EvidenceError(f"receipt section name {key!r} is {type(key).__name__}, expected str")
        clash = sorted(RESERVED_KEYS & fields.keys())
        if clash:
            raise EvidenceError(f"receipt sections {clash} are reserved (set by the writer)")
        for key, value in fields.items():
            try:
                check_json(value, key)
            except (TypeError, ValueError) as e:
                raise EvidenceError(f"receipt field {e}") from None
        self._check_nondeterministic(fields)
        self._check_no_strays()
        manifest = self.manifest
        receipt: dict[str, Any] = {
            "schema": SCHEMA,
            "version": VERSION,
            "created_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "provenance": self.provenance,
            **fields,
            "manifest": manifest,
            "manifest_sha256": canonical_sha256(manifest),
        }
        receipt["receipt_sha256"] = canonical_sha256(receipt)
        atomic_write_json(self.receipt_path, receipt, overwrite=False, indent=2, ensure_ascii=True)
        self._committed = True
        return self.receipt_path

    def _check_nondeterministic(self, fields: Mapping[str, Any]) -> None:
        marked = fields.get(NONDETERMINISTIC_KEY)
        if marked is None:
            return
        if not isinstance(marked, list) or not all(isinstance(m, str) for m in marked):
            raise EvidenceError(f"{NONDETERMINISTIC_KEY!r} must be a list of section names or artifact paths")
        known = (fields.keys() - {NONDETERMINISTIC_KEY}) | self._entries.keys()
        unknown = sorted(set(marked) - known)
        if unknown:
            raise EvidenceError(f"{NONDETERMINISTIC_KEY!r} names {unknown}, which are neither receipt sections "
                                "nor recorded artifact paths")

    def _check_no_strays(self) -> None:
        # A receipt that would fail verification must not be committed.
        on_disk = {p.relative_to(self.run_dir).as_posix() for p in self.artifacts_dir.rglob("*") if not p.is_dir()}
        strays = sorted(on_disk - self._entries.keys())
        if strays:
            raise EvidenceError(f"files under {self.artifacts_dir} not added through the writer: {strays}")


def load_receipt(path: str | os.PathLike) -> dict[str, Any]:
    """Read a receipt strictly (standard JSON, no duplicate keys, an object); EvidenceError if not."""
    path = Path(path)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            raise ValueError("duplicate key in a JSON object")
        return obj

    def no_constants(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EvidenceError(f"cannot read receipt {path}: {e}") from None
    try:
        receipt = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except ValueError as e:
        raise EvidenceError(f"receipt {path} is not valid JSON: {e}") from None
    if not isinstance(receipt, dict):
        raise EvidenceError(f"receipt {path} is not a JSON object")
    return receipt


def receipt_file(path: str | os.PathLike) -> Path:
    """A receipt.json, or the run directory holding one -> the receipt.json's path."""
    path = Path(path)
    return path / RECEIPT_NAME if path.is_dir() else path


def verify(receipt_path: str | os.PathLike) -> list[str]:
    """Recompute every hash of a receipt and its artifacts; return the failures (empty = valid).

    `receipt_path` may also be the run directory. Checks: readable standard JSON, schema/version,
    receipt_sha256, manifest_sha256, each manifest path (plain, under artifacts/, no symlinks),
    each artifact's presence, size and sha256, that artifacts/ holds nothing unlisted, and that the hashes the
    receipt quotes (e.g. training.lora_sha256_after) are those of the artifacts they name and its LoRA digests those
    of the files' values (`cross_refs`), and that
    the places a receipt states its samples agree (completions, rewards, sampler records, their tokens detokenised,
    completion_tokens.npy: `text_refs`), and a closure receipt's per-process records (`closure_check`).
    """
    receipt_path = receipt_file(receipt_path)
    try:
        receipt = load_receipt(receipt_path)
        artifacts = artifacts_dir_name(receipt_path.name)
    except EvidenceError as e:
        return [str(e)]
    schema, version = receipt.get("schema"), receipt.get("version")
    if schema != SCHEMA or type(version) is not int or version != VERSION:
        return [f"unsupported receipt: schema {schema!r} version {version!r} (expected {SCHEMA!r} version {VERSION})"]

    failures = []
    claimed = receipt.get("receipt_sha256")
    try:
        actual = canonical_sha256({k: v for k, v in receipt.items() if k != "receipt_sha256"})
    except (TypeError, ValueError) as e:
        actual = None
        failures.append(f"receipt.json cannot be hashed canonically: {e}")
    if actual is not None and claimed != actual:
        failures.append(f"receipt.json was modified: receipt_sha256 is {claimed!r} but the contents hash to {actual}")

    manifest = receipt.get("manifest")
    if not isinstance(manifest, list):
        failures.append("receipt.json has no 'manifest' list")
        return failures
    claimed_manifest = receipt.get("manifest_sha256")
    try:
        actual_manifest = canonical_sha256(manifest)
    except (TypeError, ValueError) as e:
        actual_manifest = None
        failures.append(f"manifest cannot be hashed canonically: {e}")
    if actual_manifest is not None and claimed_manifest != actual_manifest:
        failures.append(f"manifest_sha256 mismatch: receipt says {claimed_manifest!r}, manifest hashes to "
                        f"{actual_manifest}")

    run_dir = receipt_path.parent
    listed: set[str] = set()
    readable: set[str] = set()  # artifacts that verified: the cross-reference checks read only these
    for i, entry in enumerate(manifest):
        problem = _entry_problem(entry, artifacts)
        if problem:
            failures.append(f"manifest entry {i} is malformed: {problem}")
            continue
        path = entry["path"]
        if path in listed:
            failures.append(f"manifest lists {path} twice")
            continue
        listed.add(path)
        failure = _check_artifact(run_dir, entry, artifacts)
        if failure:
            failures.append(failure)
        else:
            readable.add(path)
    failures += [f"unexpected file not in the manifest: {p}" for p in _files_under(run_dir, artifacts)
                 if p not in listed]
    from glm52_jax.evidence.closure_check import closure_failures
    from glm52_jax.evidence.cross_refs import quoted_digest_failures, quoted_hash_failures
    from glm52_jax.evidence.text_refs import text_failures

    return (failures + quoted_hash_failures(receipt) + quoted_digest_failures(run_dir, receipt, readable)
            + text_failures(run_dir, receipt, readable) + closure_failures(receipt_path, receipt, artifacts))


def _entry_problem(entry: Any, artifacts: str) -> str | None:
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        return f"expected an object with keys {sorted(_ENTRY_KEYS)}"
    path = entry["path"]
    if not isinstance(path, str):
        return "'path' is not a string"
    problem = _name_problem(path)
    if problem:
        return f"path {path!r} {problem}"
    if not path.startswith(artifacts + "/"):
        return f"path {path!r} is not under {artifacts}/"
    if type(entry["bytes"]) is not int or entry["bytes"] < 0:
        return f"{path}: 'bytes' is not a non-negative integer"
    sha = entry["sha256"]
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        return f"{path}: 'sha256' is not a lowercase hex sha256"
    if not isinstance(entry["kind"], str):
        return f"{path}: 'kind' is not a string"
    return None


def _check_artifact(run_dir: Path, entry: Mapping[str, Any], artifacts: str) -> str | None:
    path = entry["path"]
    file = run_dir / PurePosixPath(path)
    if file.is_symlink():
        return f"artifact {path} is a symlink, not a regular file"
    if not file.exists():
        return f"artifact missing: {path}"
    if not file.is_file():
        return f"artifact {path} is not a regular file"
    # A symlinked parent directory could point the path outside the run directory.
    if not file.resolve().is_relative_to((run_dir / artifacts).resolve()):
        return f"artifact {path} resolves outside {artifacts}/ (symlinked directory)"
    size = file.stat().st_size
    if size != entry["bytes"]:
        return f"artifact size mismatch: {path} has {size} bytes, manifest says {entry['bytes']}"
    sha = sha256_file(file)
    if sha != entry["sha256"]:
        return f"artifact sha256 mismatch: {path} hashes to {sha}, manifest says {entry['sha256']}"
    return None


def _files_under(run_dir: Path, artifacts: str) -> list[str]:
    """Run-dir-relative POSIX paths of everything under the artifacts dir that is not a plain directory."""
    root = run_dir / artifacts
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked directories
        rel = Path(dirpath).relative_to(run_dir)
        found += [(rel / d).as_posix() for d in dirnames if (Path(dirpath) / d).is_symlink()]
        found += [(rel / f).as_posix() for f in filenames]
    return sorted(found)


def deterministic_view(receipt: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The part of a receipt that two runs of the same transaction should reproduce exactly.

    Drops created_utc, receipt_sha256, manifest_sha256 (derived from the manifest, which stays),
    provenance (where and with what it ran, not what it computed), every section named in the
    receipt's "nondeterministic" list, and manifest entries whose path is named there.
    Accepts a receipt dict or a path to one.
    """
    if not isinstance(receipt, Mapping):
        receipt = load_receipt(receipt)
    listed = receipt.get(NONDETERMINISTIC_KEY)
    marked = {m for m in listed if isinstance(m, str)} if isinstance(listed, list) else set()
    drop = {"created_utc", "receipt_sha256", "manifest_sha256", "provenance"} | marked
    view = {k: copy.deepcopy(v) for k, v in receipt.items() if k not in drop}
    if isinstance(view.get("manifest"), list):
        view["manifest"] = [e for e in view["manifest"] if not (isinstance(e, dict) and e.get("path") in marked)]
    return view
