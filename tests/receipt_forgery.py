"""Re-sealed copies of the committed receipts: what a forger who recomputes every hash would hand to `verify`.

A copy passes the hash checks by construction, so a test that edits it shows which of verify's other checks
(decisions from metrics, quoted hashes, the data file, texts against tokens) catches the edit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from glm52_jax.evidence import canonical_sha256


def resealed(committed: Path, directory: Path, edit: Callable[[dict, Path], None]) -> Path:
    """A copy of `committed` and its artifacts under `directory` with `edit(receipt, artifacts_dir)` applied (it may
    rewrite artifact files too), then every manifest entry's size and sha256, manifest_sha256 and receipt_sha256
    recomputed. Returns the copy's receipt path."""
    directory.mkdir(parents=True, exist_ok=True)
    artifacts = directory / committed.stem
    shutil.copytree(committed.with_suffix(""), artifacts)
    receipt = json.loads(committed.read_text())
    edit(receipt, artifacts)
    for entry in receipt["manifest"]:
        data = (directory / entry["path"]).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    receipt.pop("receipt_sha256")
    receipt["manifest_sha256"] = canonical_sha256(receipt["manifest"])
    receipt["receipt_sha256"] = canonical_sha256(receipt)
    path = directory / committed.name
    path.write_text(json.dumps(receipt, indent=2))
    return path
