"""CLI for evidence receipts.

    python -m glm52_jax.evidence verify RECEIPT [--json]   # exit 0 valid, 1 failures, 2 usage (a parity receipt's
                                                           # decisions are recomputed from its metrics too)
    python -m glm52_jax.evidence verify --recompute-rewards RECEIPT   # also re-score every stored reward
    python -m glm52_jax.evidence verify --data FILE RECEIPT   # the scored rows re-read from the run's data file
                                                           # (with --recompute-rewards: re-scored against FILE's)
    python -m glm52_jax.evidence verify WORKDIR            # every committed receipt of a run
    python -m glm52_jax.evidence show RECEIPT              # short summary (does not verify)
    python -m glm52_jax.evidence publish RECEIPT DIR/NAME.json   # a verified receipt under its own name
    python -m glm52_jax.evidence compare RECEIPT RECEIPT   # what two runs computed differently (exit 1 if any)
    python -m glm52_jax.evidence readiness ONLINE PARITY   # ready_for_2m_training (exit 0) or its blockers (1);
                                                           # rules: evidence/readiness.py, docs/evidence.md

RECEIPT is a receipt.json or the directory holding it; WORKDIR a run's workdir or its evidence/
directory (every step's receipt and the named receipts, `evidence.run_dir`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from glm52_jax.evidence.data_check import DataFile, check_data, read_data_file
from glm52_jax.evidence.parity_check import parity_decision_failures
from glm52_jax.evidence.receipt import (
    NONDETERMINISTIC_KEY,
    RESERVED_KEYS,
    EvidenceError,
    load_receipt,
    receipt_file,
    verify,
)
from glm52_jax.evidence.rewards_check import recompute_rewards
from glm52_jax.evidence.run_dir import find_receipts


def _check(path: Path, recompute: bool, data: DataFile | None = None) -> dict[str, Any]:
    """One receipt's verification record: ok, failures, artifacts, manifest sha256 (and rewards recomputed, the
    scored rows checked against `data`, a parity receipt's decisions recomputed from its metrics, and which
    tokenizer detokenised the sampled tokens)."""
    from glm52_jax.evidence.text_refs import detokenizer

    failures = verify(path)
    rewards, truths = None, None
    if data is not None:  # also when a hash fails, as below
        data_lines, truths = check_data(path, data)
        failures += data_lines
    if recompute:  # also when a hash fails: every difference is worth naming
        reward_failures, rewards = recompute_rewards(path, ground_truths=truths)
        failures += reward_failures
    failures = list(dict.fromkeys(failures))  # verify's cross-references and the recomputation share some lines
    try:
        receipt = load_receipt(receipt_file(path))
    except EvidenceError:
        receipt = None  # verify named why
    decided = 0
    if isinstance(receipt, dict):  # also when a hash fails, as above
        decision_failures, decided = parity_decision_failures(receipt)
        failures += decision_failures
    manifest, manifest_sha = None, None
    if not failures:
        manifest, manifest_sha = receipt["manifest"], receipt["manifest_sha256"]
    record = {"ok": not failures, "receipt": str(path), "failures": failures,
              "artifacts": None if manifest is None else len(manifest), "manifest_sha256": manifest_sha}
    if recompute:
        record["rewards_recomputed"] = rewards
    if data is not None:
        record["data"] = {"path": data.path, "sha256": data.sha256, "rows_checked": truths is not None}
    if isinstance(receipt, dict) and isinstance(receipt.get("completions"), list):
        tokenizer, where = detokenizer(receipt)
        record["detokenised_with" if tokenizer is not None else "not_detokenised"] = where
    if decided:
        record["parity_decisions_recomputed"] = decided
    return record


def _lines(record: dict[str, Any]) -> list[str]:
    if record["failures"]:
        return list(record["failures"])
    lines = [f"OK {record['artifacts']} artifacts, manifest {record['manifest_sha256']}"]
    if "parity_decisions_recomputed" in record:
        lines.append(f"OK {record['parity_decisions_recomputed']} parity decisions recomputed from their metrics and "
                     "bounds, all equal to the stored ones")
    if "rewards_recomputed" in record:
        lines.append(f"OK {record['rewards_recomputed']} rewards recomputed with the DAPO rule"
                     + (" against the data file's ground truths" if "data" in record else "")
                     + ", all equal to the stored ones")
    if "data" in record:
        lines.append(f"OK data file {record['data']['path']} is the one the run read (sha256 "
                     f"{record['data']['sha256']}); every scored row and ground truth re-read from it")
    if "detokenised_with" in record:
        lines.append(f"OK sampled texts equal their tokens detokenised with {record['detokenised_with']}")
    elif "not_detokenised" in record:
        lines.append(f"NOTE sampled texts not compared with their tokens: {record['not_detokenised']}")
    return lines


def _verify(path: Path, as_json: bool, recompute: bool, data_path: str | None = None) -> int:
    data = None
    if data_path is not None:
        try:
            data = read_data_file(data_path)
        except EvidenceError as e:
            print(e)
            return 2
    found = find_receipts(path)
    records = [_check(p, recompute, data) for p in found.receipts]
    if found.single:
        record = records[0]
        print(json.dumps(record) if as_json else "\n".join(_lines(record)))
        return 0 if record["ok"] else 1
    # A run: every receipt, each line prefixed with the receipt's path in the run; then the tally.
    ok = sum(r["ok"] for r in records)
    failed = len(records) - ok
    unverified = [(d.relative_to(path).as_posix(), why) for d, why in found.unverified]
    if as_json:
        print(json.dumps({"ok": bool(records) and not failed, "run": str(path), "receipts": records,
                          "not_verified": [{"path": d, "why": why} for d, why in unverified]}))
    else:
        for record in records:
            name = Path(record["receipt"]).relative_to(path).as_posix()
            print("\n".join(f"{name}: {line}" for line in _lines(record)))
        for d, why in unverified:
            print(f"{d}: not verified ({why})")
        if not records:
            print(f"FAILED: no receipt under {path} (a receipt.json, its directory, or a run's workdir)")
        else:
            print(f"{'OK' if not failed else 'FAILED'}: {ok} of {len(records)} receipts verified")
    return 0 if records and not failed else 1


def summary_lines(receipt: dict[str, Any]) -> list[str]:
    """Human summary of a receipt: identity, provenance, sections, artifacts (no verification)."""
    prov = receipt.get("provenance") or {}
    git = prov.get("git") or {}
    dirty = {True: " (dirty)", False: "", None: ""}.get(git.get("dirty"), "")
    manifest = receipt.get("manifest") or []
    sections = [k for k in receipt if k not in RESERVED_KEYS and k != NONDETERMINISTIC_KEY]
    lines = [
        f"schema    {receipt.get('schema')} v{receipt.get('version')}",
        f"created   {receipt.get('created_utc')}",
        f"source    {prov.get('source_sha256')} ({prov.get('source_files')} files)",
        f"git       {git.get('commit')}{dirty}",
        f"sections  {', '.join(sections) or '-'}",
    ]
    if isinstance(receipt.get(NONDETERMINISTIC_KEY), list):
        lines.append(f"nondet    {', '.join(map(str, receipt[NONDETERMINISTIC_KEY]))}")
    total = sum(e.get("bytes", 0) for e in manifest if isinstance(e, dict) and isinstance(e.get("bytes"), int))
    lines.append(f"artifacts {len(manifest)} ({total} bytes), manifest {receipt.get('manifest_sha256')}")
    lines += [f"  {str(e.get('kind', '?')):<16} {str(e.get('bytes', '?')):>12}  {e.get('path')}"
              for e in manifest if isinstance(e, dict)]
    lines.append(f"receipt   {receipt.get('receipt_sha256')}  (not verified; use `verify`)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (argparse exits 2 itself on usage errors)."""
    parser = argparse.ArgumentParser(prog="python -m glm52_jax.evidence", description="Evidence receipt tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_verify = sub.add_parser("verify", help="recompute all hashes; exit 1 naming each failure")
    p_verify.add_argument("receipt", help="receipt.json, its directory, or a run's workdir (every committed receipt)")
    p_verify.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p_verify.add_argument("--recompute-rewards", action="store_true",
                          help="also recompute every stored reward from its stored text and ground truth (DAPO rule)")
    p_verify.add_argument("--data", metavar="FILE",
                          help="the DAPO data file the run read (.jsonl/.parquet; the shipped problems: "
                               "glm52_jax/assets/math_problems.jsonl): check its sha256 is the receipt's and every "
                               "scored row's ground truth is FILE's; with --recompute-rewards, re-score against FILE")
    p_show = sub.add_parser("show", help="print a short summary of a receipt")
    p_show.add_argument("receipt", help="receipt.json or its directory")
    p_publish = sub.add_parser("publish", help="copy a verified receipt (and its artifacts) under a name of its own")
    p_publish.add_argument("receipt", help="receipt.json, its directory, or a named receipt")
    p_publish.add_argument("dest", help="DIR/NAME.json (artifacts go to DIR/NAME/); never overwritten")
    p_compare = sub.add_parser("compare", help="what two receipts of the same transaction computed differently")
    p_compare.add_argument("first")
    p_compare.add_argument("second")
    p_compare.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance for numbers (1e-5)")
    p_compare.add_argument("--noise", type=float, default=0.0,
                           help="absolute float-rounding level of measured numbers (0); parity receipts from "
                                "another machine: 1e-5, the exact modes' bound")
    p_ready = sub.add_parser("readiness", help="the seed's ready_for_2m_training decision from an online and a "
                                               "parity receipt (exit 0 ready, 1 blocked, 2 bad input)")
    p_ready.add_argument("online", help="an online GRPO receipt (one transaction)")
    p_ready.add_argument("parity", help="a gradient-parity receipt")
    p_ready.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p_ready.add_argument("--online-tokens", type=int, default=2_097_152, help="the online prompt's length (exact 2M)")
    p_ready.add_argument("--parity-tokens", type=int, default=32_768, help="the parity prompt's least length (32K)")
    args = parser.parse_args(argv)

    if args.command == "readiness":
        from glm52_jax.evidence import readiness

        return readiness.main(args.online, args.parity, as_json=args.json, online_tokens=args.online_tokens,
                              parity_tokens=args.parity_tokens)
    if args.command == "verify":
        return _verify(Path(args.receipt), args.json, args.recompute_rewards, args.data)
    if args.command in ("publish", "compare"):
        from glm52_jax.evidence.publish import publish, result_differences

        try:
            if args.command == "publish":
                print(f"published {publish(args.receipt, args.dest)}")
                return 0
            diffs = result_differences(receipt_file(args.first), receipt_file(args.second), args.rtol,
                                       noise=args.noise)
        except EvidenceError as e:
            print(e)
            return 1
        print("\n".join(diffs) if diffs else "same results")
        return 1 if diffs else 0
    path = receipt_file(args.receipt)
    try:
        receipt = load_receipt(path)
    except EvidenceError as e:
        print(e)
        return 1
    print("\n".join(summary_lines(receipt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
