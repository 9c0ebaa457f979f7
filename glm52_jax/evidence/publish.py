"""A verified receipt published under a name of its own, and two receipts' results compared.

`publish` is how the repository's `evidence/` receipts are made from a run: a step's
`evidence/step_000001/receipt.json` (artifacts in `artifacts/`) becomes `evidence/online_grpo_tiny.json`
(artifacts in `online_grpo_tiny/`). Only the manifest paths change (their directory), so the manifest and
receipt hashes are recomputed, and the receipt gains a `published` section binding it to the original's
hashes. The source must verify first; the artifacts are copied into a temporary directory, checked
against the manifest, moved into place, and the receipt is written last, so an interrupted publish leaves
no receipt (and never overwrites one).

`result_differences` compares what two runs of the same transaction computed (a regenerated receipt
against a committed one): `deterministic_view` of each, without the `published` section, the artifacts'
directory prefix, hashes (every key naming a sha256 or a digest, e.g. `lora_sha256_after`, `grads_digest`) and byte
counts (hashes of float data differ with the last bit of a float, which another CPU's XLA code generation changes;
`verify` checks each receipt's own), absolute paths, and the sections the receipt marks nondeterministic; numbers
within a relative tolerance, everything else exactly.
"""

from __future__ import annotations

import fnmatch
import math
import os
import shutil
from pathlib import Path
from typing import Any

from glm52_jax.evidence.atomic import atomic_write_json
from glm52_jax.evidence.hashing import sha256_file
from glm52_jax.evidence.provenance import canonical_sha256
from glm52_jax.evidence.receipt import (
    NONDETERMINISTIC_KEY,
    EvidenceError,
    artifacts_dir_name,
    deterministic_view,
    load_receipt,
    receipt_file,
    verify,
)

PUBLISHED_KEY = "published"


def _renamed(path: str, old: str, new: str) -> str:
    return new + path[len(old):] if path.startswith(old + "/") else path


def publish(source: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy the verified receipt at `source` (a receipt.json, its directory, or a named receipt) to `dest`
    (`DIR/NAME.json`, artifacts in `DIR/NAME/`); returns `dest`. Refuses an unverifiable source and an
    existing `dest` or artifacts directory."""
    source, dest = receipt_file(source), Path(dest)
    failures = verify(source)
    if failures:
        raise EvidenceError(f"{source} does not verify ({failures[0]}); publish only a valid receipt")
    new_dir = artifacts_dir_name(dest.name)
    final_dir = dest.parent / new_dir
    for taken in (dest, final_dir):
        if taken.exists():
            raise EvidenceError(f"{taken} exists; remove it first (a published receipt is never overwritten)")
    receipt = load_receipt(source)
    old_dir = artifacts_dir_name(source.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{new_dir}.publishing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    manifest = []
    try:
        for entry in receipt["manifest"]:
            rel = _renamed(entry["path"], old_dir, new_dir)
            target = staging / Path(rel).relative_to(new_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source.parent / entry["path"], target)
            if sha256_file(target) != entry["sha256"]:
                raise EvidenceError(f"artifact {entry['path']} changed while it was copied")
            manifest.append({**entry, "path": rel})
        staging.rename(final_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    out = {k: v for k, v in receipt.items() if k not in ("manifest", "manifest_sha256", "receipt_sha256")}
    if isinstance(out.get(NONDETERMINISTIC_KEY), list):
        out[NONDETERMINISTIC_KEY] = [_renamed(m, old_dir, new_dir) for m in out[NONDETERMINISTIC_KEY]]
    out[PUBLISHED_KEY] = {"from": source.name, "receipt_sha256": receipt["receipt_sha256"],
                          "manifest_sha256": receipt["manifest_sha256"]}
    out["manifest"] = manifest
    out["manifest_sha256"] = canonical_sha256(manifest)
    out["receipt_sha256"] = canonical_sha256(out)
    atomic_write_json(dest, out, overwrite=False, indent=2, ensure_ascii=True)
    return dest


def _results(receipt: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """`deterministic_view` without what may differ between two faithful runs (see the module doc)."""
    if not isinstance(receipt, dict):
        receipt = load_receipt(receipt)
    view = deterministic_view(receipt)
    view.pop(PUBLISHED_KEY, None)
    view.pop(NONDETERMINISTIC_KEY, None)
    view["manifest"] = sorted((e["path"].split("/", 1)[-1], e.get("kind")) for e in view.get("manifest", []))
    return view


def _at_noise(section: dict, noise: float) -> bool:
    """Whether a parity pair (`families.all.rel_l2` beside its `outliers`) agrees at rounding level."""
    rel = section.get("families", {}).get("all", {}).get("rel_l2") if "outliers" in section else None
    return isinstance(rel, (int, float)) and not isinstance(rel, bool) and rel <= noise


def _walk(a: Any, b: Any, where: str, rtol: float, out: list[str], ignore: frozenset[str] = frozenset(),
          noise: float = 0.0) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        rounding = noise > 0 and _at_noise(a, noise) and _at_noise(b, noise)
        for key in sorted(a.keys() | b.keys()):
            path = f"{where}.{key}"
            if ("sha256" in key or "digest" in key or key == "bytes"
                    or any(fnmatch.fnmatchcase(path, p) for p in ignore) or (rounding and key == "outliers")):
                continue
            if key not in a or key not in b:
                out.append(f"{path}: only in the {'first' if key in a else 'second'}")
            else:
                _walk(a[key], b[key], path, rtol, out, ignore, noise)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} vs {len(b)} items")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                _walk(x, y, f"{where}[{i}]", rtol, out, ignore, noise)
    elif isinstance(a, float) or isinstance(b, float):
        numbers = isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
        if not (numbers and math.isclose(a, b, rel_tol=rtol, abs_tol=max(rtol * 1e-2, noise))):
            out.append(f"{where}: {a!r} vs {b!r}")
    elif isinstance(a, str) and isinstance(b, str) and a.startswith("/") and b.startswith("/"):
        return  # absolute paths: where each run lived
    elif a != b:
        out.append(f"{where}: {a!r} vs {b!r}")


def result_differences(first, second, rtol: float = 1e-5, ignore=(), noise: float = 0.0) -> list[str]:
    """What two receipts (dicts or paths) computed differently; empty when they reproduce each other.
    `ignore`: further keys as dotted paths from the receipt (e.g. "topology.devices"; `*` matches any part)
    left out. `noise`: the absolute size of float rounding in the measured numbers (0: none): two numbers
    within it of each other are equal, and a parity pair that agrees within it (`families.all.rel_l2 <= noise`
    in both) has no comparable `outliers`: its largest per-parameter differences are rounding, ranked by
    rounding, which another CPU's code changes (measured: 284 such entries differ between two machines, every
    decision the same)."""
    out: list[str] = []
    _walk(_results(first), _results(second), "receipt", rtol, out, frozenset(f"receipt.{k}" for k in ignore), noise)
    return out
