"""The receipts a path names: one receipt, or every committed receipt of a run's workdir.

`python -m glm52_jax.evidence verify PATH` takes a receipt file, the directory holding `receipt.json`,
a run's workdir or its `evidence/` directory. A workdir's evidence (rl/run.py, rl/parity.py) is

    evidence/step_000001/receipt.json        one per committed transaction
    evidence/gradient_parity_tiny.json       named receipts, artifacts in the directory of their stem
    evidence/step_000003.uncommitted-1/      a step set aside on resume (its checkpoint never committed)

The steps' and the named receipts are verified; every other directory there (set-aside steps, a
step killed before its receipt) is listed as not verified, so nothing is skipped silently.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from glm52_jax.evidence.receipt import RECEIPT_NAME, receipt_file

EVIDENCE_DIR = "evidence"
STEP_DIR_RE = re.compile(r"step_\d{6}")


@dataclasses.dataclass(frozen=True)
class Receipts:
    """`receipts` to verify; `single`: PATH named one receipt; `unverified`: (directory, why) of the rest."""

    receipts: list[Path]
    single: bool
    unverified: list[tuple[Path, str]]


def find_receipts(path: str | os.PathLike) -> Receipts:
    """The receipts `path` names (a missing path is a single receipt, which `verify` reports unreadable)."""
    path = Path(path)
    if not path.is_dir() or (path / RECEIPT_NAME).is_file():
        return Receipts([receipt_file(path)], True, [])
    evidence = path / EVIDENCE_DIR if (path / EVIDENCE_DIR).is_dir() else path
    entries = sorted(evidence.iterdir())
    named = [e for e in entries if e.is_file() and e.suffix == ".json" and (evidence / e.stem).is_dir()]
    artifact_dirs = {e.stem for e in named}
    receipts, unverified = list(named), []
    for entry in entries:
        if not entry.is_dir() or entry.name in artifact_dirs:
            continue
        if STEP_DIR_RE.fullmatch(entry.name) and (entry / RECEIPT_NAME).is_file():
            receipts.append(entry / RECEIPT_NAME)
        elif STEP_DIR_RE.fullmatch(entry.name):
            unverified.append((entry, f"no {RECEIPT_NAME}: the step did not commit"))
        else:
            unverified.append((entry, "not a committed step"))
    return Receipts(sorted(receipts), False, unverified)
