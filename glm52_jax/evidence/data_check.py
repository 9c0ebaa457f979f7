"""A receipt's scored rows against the data file they came from: `verify --data FILE RECEIPT`.

An online receipt binds its data file in "prompt.data" (a parity receipt in "fixture.data", with the data cursor its
search started from): the path as given, whether it is the shipped set, the sha256 of its bytes, `dedupe`
(`rl.inputs.source_record`), and per candidate tried the row it scored (its 0-based record position in the file,
"row", and the row's own `extra_info.index`). Without the file a forger can change a candidate's ground truth and its
rewards together and re-seal every hash; with it `verify --data` checks that FILE is the file the run read (sha256),
that the data cursor selects each candidate's row, and that every stored ground truth is that row's (the rewards
artifact), so the rewards are re-scored against FILE's ground truth (`--recompute-rewards`), not the receipt's.

Rows are read with the run's own parser (`dapo_data`: the standard library; a Parquet file needs pyarrow), so the
evidence package still starts without JAX or numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glm52_jax.evidence.receipt import EvidenceError

DATA_KEY = "data"  # under one of these sections (the first the receipt has)
BOUND_IN = ("prompt", "fixture")


@dataclasses.dataclass(frozen=True)
class DataFile:
    """A data file as `verify --data` read it: its path as given, sha256, and rows in file order (row k at [k])."""

    path: str
    sha256: str
    rows: tuple  # dapo_data.DapoRow, index = position

    @functools.cached_property
    def deduped(self) -> list:
        """The rows a run with `data.dedupe` reads (computed once for every receipt checked)."""
        from glm52_jax.dapo_data import dedupe_rows

        return dedupe_rows(self.rows)

    @functools.cached_property
    def ground_truths(self) -> dict[int, str]:
        """{row position: ground truth}."""
        return {r.index: r.ground_truth for r in self.rows}


def read_data_file(path: str | os.PathLike) -> DataFile:
    """Hash and parse `path`; EvidenceError with one line naming the file when it is missing or not DAPO rows."""
    from glm52_jax.dapo_data import load_rows
    from glm52_jax.evidence.hashing import sha256_file

    where = f"--data {os.fspath(path)}"
    if not Path(path).is_file():
        raise EvidenceError(f"{where}: no such file (the DAPO .jsonl/.parquet file the run read; the shipped "
                            "problems are glm52_jax/assets/math_problems.jsonl)")
    try:
        rows = load_rows(path)
        digest = sha256_file(path)
    except (OSError, ValueError, ImportError) as e:  # DapoFormatError names the row and field
        raise EvidenceError(f"{where}: cannot read its rows: {e}") from None
    return DataFile(os.fspath(path), digest, tuple(rows))


def _binding(receipt: Mapping[str, Any]) -> dict | str:
    """The receipt's data binding ("prompt.data" of a step receipt, "fixture.data" of a parity receipt, which
    carries its own "data_cursor"), or why it has no usable one."""
    for section in BOUND_IN:
        data = receipt[section].get(DATA_KEY) if isinstance(receipt.get(section), Mapping) else None
        if data is not None:
            break
    else:
        return "the receipt binds no data file (no 'prompt.data' or 'fixture.data' section: written before " \
               "receipts recorded their data), so --data has nothing to check"
    if not (isinstance(data, Mapping) and isinstance(data.get("sha256"), str) and isinstance(data.get("rows"), list)):
        return f"receipt section '{section}.data' must hold a 'sha256' string and a 'rows' list, got {data!r}"
    return {**data, "section": f"{section}.{DATA_KEY}"}


def _selected(data: DataFile, dedupe: Any, cursor: Any, candidate: Any) -> int | None:
    """The file position of the row the run's data cursor gives candidate `candidate` (None: not recorded)."""
    if not isinstance(cursor, int) or not isinstance(candidate, int) or not data.rows:
        return None
    rows = data.deduped if dedupe is True else data.rows
    return rows[(cursor + candidate) % len(rows)].index


def data_failures(receipt: Mapping[str, Any], candidates: Any, rewards_path: str,
                  data: DataFile) -> tuple[list[str], dict[int, str] | None]:
    """(a line per difference, {row position: FILE's ground truth} to re-score with; None when FILE is not the
    receipt's data file). `candidates`: the receipt's rewards artifact (`rewards_path`), one record per candidate."""
    binding = _binding(receipt)
    if isinstance(binding, str):
        return [binding], None
    if binding["sha256"] != data.sha256:
        return [f"--data {data.path}: sha256 {data.sha256}, but the receipt's data file ({binding.get('path')}) has "
                f"sha256 {binding['sha256']}: not the file this run read"], None
    transaction = receipt.get("transaction")
    cursor = binding.get("data_cursor", transaction.get("data_cursor") if isinstance(transaction, Mapping) else None)
    listed = {r.get("candidate"): r for r in binding["rows"] if isinstance(r, Mapping)}
    failures: list[str] = []
    records = candidates if isinstance(candidates, list) else []
    if len(listed) != len(records):
        failures.append(f"receipt section '{binding['section']}.rows' lists {len(listed)} candidates, {rewards_path} "
                        f"{len(records)}")
    for cd in records:
        if not isinstance(cd, Mapping):
            continue  # the reward recomputation names a malformed record
        i, pos = cd.get("candidate"), cd.get("row")
        where = f"{rewards_path}: candidate {i}"
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < len(data.rows):
            failures.append(f"{where}: row {pos!r} is not a row of {data.path} ({len(data.rows)} rows)")
            continue
        row = data.rows[pos]
        selected = _selected(data, binding.get("dedupe"), cursor, i)
        if selected is not None and selected != pos:
            failures.append(f"{where}: scored row {pos}, but data cursor {cursor} gives candidate {i} row {selected} "
                            f"of {data.path}")
        if cd.get("ground_truth") != row.ground_truth:
            failures.append(f"{where}: row {pos}: ground truth {cd.get('ground_truth')!r}, but row {pos} of "
                            f"{data.path} has {row.ground_truth!r}")
        entry = listed.get(i)
        if entry is not None and (entry.get("row"), entry.get("extra_info_index")) != (pos, row.uid):
            failures.append(f"receipt section '{binding['section']}.rows': candidate {i} is row {entry.get('row')!r} "
                            f"(extra_info.index {entry.get('extra_info_index')!r}), but {rewards_path} scored row "
                            f"{pos}, whose extra_info.index in {data.path} is {row.uid!r}")
    return failures, data.ground_truths


def check_data(receipt_path: str | os.PathLike, data: DataFile) -> tuple[list[str], dict[int, str] | None]:
    """`data_failures` over every rewards artifact of the receipt at `receipt_path` (hashes are `verify`'s)."""
    from glm52_jax.evidence.receipt import load_receipt, receipt_file
    from glm52_jax.evidence.rewards_check import artifacts_of_kind, read_artifact_json
    from glm52_jax.evidence.text_refs import REWARDS_KIND

    path = receipt_file(receipt_path)
    try:
        receipt = load_receipt(path)
    except EvidenceError as e:
        return [str(e)], None
    paths = artifacts_of_kind(receipt, REWARDS_KIND)
    if not paths:
        return [f"{path}: no artifact of kind {REWARDS_KIND!r}: no scored rows to check against --data"], None
    failures: list[str] = []
    truths = None
    for rewards_path in paths:
        try:
            candidates = read_artifact_json(path.parent, rewards_path)
        except EvidenceError as e:
            failures.append(str(e))
            continue
        lines, truths = data_failures(receipt, candidates, rewards_path, data)
        failures += lines
    return failures, truths
