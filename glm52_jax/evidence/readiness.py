"""The seed's training-readiness decision, computed from two verified receipts.

    python -m glm52_jax.evidence readiness ONLINE_RECEIPT PARITY_RECEIPT [--json]
    # exit 0: ready_for_2m_training; 1: blocked (each blocker named); 2: bad input (not two receipts of these kinds)

The seed decided `ready_for_2m_training` from an exact-2M online GRPO transaction and a 32K gradient-parity
comparison (shared/seed: "The exact-2M online rollout and update passed. The 32K conventional-versus-response-only
gradient comparison is also passed."). The rules below are that decision made checkable; docs/evidence.md states
them for users. Every rule that fails is a blocker:

online receipt (one transaction)
  O1 it verifies (every hash) and every stored reward recomputes to itself with the DAPO rule;
  O2 its prompt is exactly `online_tokens` tokens (2,097,152: exact 2M);
  O3 the group's rewards differ (a GRPO advantage that is not zero: the update learns something);
  O4 the update ran: `training.status` "updated", exactly one optimizer step;
  O5 numerics finite, and the sampler's prefix cache cleared afterwards (the transaction cleaned up);
  O6 the decode audit found no Unicode replacement character (bytes the tokenizer could not decode);
parity receipt (conventional vs the other modes, two cases)
  P1 it verifies, and its decisions recompute from its stored metrics and bounds (`verify` does both);
  P2 its prompt is at least `parity_tokens` tokens (32,768: the seed's 32K comparison);
  P3 its decision is "passed", over the cases `ratio1` and `active_clip`, with clipping active in `active_clip`
     (at least one token clipped high and one clipped low), every mode's gradients finite;
  P4 no optimizer step was taken and the policy state is unchanged (the comparison does not train);
both
  B1 the gradient mode the online update used is one the parity receipt compared and passed (conventional, the
     reference, passes by definition).

Separately (not a blocker, as in the seed, whose checkout stayed "review_only_not_runnable" for this reason) it
says whether each receipt is bound to this checkout: recorded at this git commit, clean, with the same source
digest as this package's files now.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glm52_jax.evidence.parity_check import parity_decision_failures
from glm52_jax.evidence.provenance import git_info, source_digest
from glm52_jax.evidence.receipt import EvidenceError, load_receipt, receipt_file, verify
from glm52_jax.evidence.rewards_check import recompute_rewards

EXACT_2M = 2_097_152
PARITY_32K = 32_768
PARITY_CASES = ("ratio1", "active_clip")
REFERENCE_MODE = "conventional"


class BadInput(ValueError):
    """Not a pair of receipts this decision reads (missing, unreadable, or of the wrong kind)."""


def _load(path: str | Path, section: str, kind: str) -> tuple[Path, dict[str, Any]]:
    try:
        file = receipt_file(path)
        receipt = load_receipt(file)
    except (EvidenceError, OSError) as e:
        raise BadInput(f"{path}: not a readable receipt ({e})") from None
    if not isinstance(receipt, dict) or not isinstance(receipt.get(section), dict):
        raise BadInput(f"{path}: not {kind} receipt (no {section!r} section)")
    return file, receipt


def _get(receipt: Mapping[str, Any], *keys: str) -> Any:
    value: Any = receipt
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def online_blockers(file: Path, receipt: Mapping[str, Any], online_tokens: int) -> list[str]:
    out = [f"O1 online: {f}" for f in verify(file)]
    reward_failures, _ = recompute_rewards(file)
    out += [f"O1 online rewards: {f}" for f in reward_failures]
    tokens = _get(receipt, "prompt", "tokens")
    if tokens != online_tokens:
        out.append(f"O2 online: the prompt is {tokens} tokens, not {online_tokens:,}")
    advantages = _get(receipt, "training", "advantages") or []
    if not any(isinstance(a, (int, float)) and a != 0 for a in advantages):
        out.append(f"O3 online: the group's rewards {receipt.get('rewards')} give no non-zero advantage")
    training = receipt.get("training") or {}
    if training.get("status") != "updated" or training.get("optimizer_steps") != 1:
        out.append(f"O4 online: training.status {training.get('status')!r} with {training.get('optimizer_steps')} "
                   "optimizer steps (needs 'updated', exactly 1)")
    if _get(receipt, "numerics", "finite") is not True:
        out.append("O5 online: numerics not finite")
    if _get(receipt, "cleanup", "prefix_cache_cleared") is not True:
        out.append("O5 online: the prefix cache was not cleared after the transaction")
    replacement = _get(receipt, "decode_audit", "replacement_chars")
    if replacement != 0:
        out.append(f"O6 online: the decode audit counted {replacement} Unicode replacement characters")
    return out


def parity_blockers(file: Path, receipt: Mapping[str, Any], parity_tokens: int) -> list[str]:
    out = [f"P1 parity: {f}" for f in verify(file)]
    out += [f"P1 parity: {f}" for f in parity_decision_failures(receipt)[0]]
    tokens = _get(receipt, "fixture", "prompt_tokens")
    if not isinstance(tokens, int) or tokens < parity_tokens:
        out.append(f"P2 parity: the prompt is {tokens} tokens, fewer than {parity_tokens:,}")
    parity = receipt["parity"]
    if parity.get("decision") != "passed":
        out.append(f"P3 parity: decision {parity.get('decision')!r}")
    cases = parity.get("cases") if isinstance(parity.get("cases"), dict) else {}
    if missing := [c for c in PARITY_CASES if c not in cases]:
        out.append(f"P3 parity: case(s) {missing} not compared")
    clipping = _get(cases, "active_clip", "clipping") or {}
    if not (clipping.get("high", 0) > 0 and clipping.get("low", 0) > 0):
        out.append(f"P3 parity: active_clip clipped {clipping.get('high')} tokens high and {clipping.get('low')} "
                   "low (needs at least one of each)")
    for case, result in cases.items():
        for mode, record in (_get(result, "modes") or {}).items():
            if _get(record, "nonfinite") != 0:
                out.append(f"P3 parity: {case}.{mode} has {_get(record, 'nonfinite')} non-finite gradient shards")
    if parity.get("optimizer_steps") != 0 or _get(receipt, "policy_state", "unchanged") is not True:
        out.append(f"P4 parity: {parity.get('optimizer_steps')} optimizer steps, policy state unchanged: "
                   f"{_get(receipt, 'policy_state', 'unchanged')}")
    return out


def passed_modes(parity: Mapping[str, Any]) -> set[str]:
    """The modes whose pairs against the reference passed in every case (the reference itself included)."""
    cases = parity.get("cases") if isinstance(parity.get("cases"), dict) else {}
    modes = {REFERENCE_MODE} if parity.get("reference") == REFERENCE_MODE else set()
    pair_modes = [set(_get(result, "pairs") or {}) for result in cases.values()]
    for mode in set().union(*pair_modes) if pair_modes else ():
        if all(_get(result, "pairs", mode, "decision") == "passed" for result in cases.values()):
            modes.add(mode)
    return modes


def binding(receipt: Mapping[str, Any], repo: str | Path | None = None) -> dict[str, Any]:
    """Whether the receipt was made by this checkout: same git commit, clean tree then, same source digest now."""
    prov = receipt.get("provenance") or {}
    here = git_info(repo)
    recorded = prov.get("git") or {}
    why = []
    if not here.get("commit"):
        why.append("this checkout has no git commit")
    elif recorded.get("commit") != here.get("commit"):
        why.append(f"recorded at commit {recorded.get('commit')}, this checkout is {here.get('commit')}")
    if recorded.get("dirty") is not False:
        why.append(f"recorded from a tree with uncommitted changes (dirty: {recorded.get('dirty')})")
    if prov.get("source_sha256") != source_digest():
        why.append("its package source digest differs from this checkout's files")
    return {"bound": not why, "why": why}


def decide(online: str | Path, parity: str | Path, *, online_tokens: int = EXACT_2M,
           parity_tokens: int = PARITY_32K) -> dict[str, Any]:
    """The decision record (raises `BadInput` on a receipt it cannot read as its kind)."""
    online_file, online_receipt = _load(online, "training", "an online GRPO")
    parity_file, parity_receipt = _load(parity, "parity", "a gradient-parity")
    blockers = online_blockers(online_file, online_receipt, online_tokens)
    blockers += parity_blockers(parity_file, parity_receipt, parity_tokens)
    mode = _get(online_receipt, "training", "mode")
    if mode not in passed_modes(parity_receipt["parity"]):
        blockers.append(f"B1 the online update used gradient_mode {mode!r}, which the parity receipt did not pass "
                        f"(passed: {sorted(passed_modes(parity_receipt['parity']))})")
    scale = "2m" if (online_tokens, parity_tokens) == (EXACT_2M, PARITY_32K) else f"{online_tokens}_token"
    return {"decision": "blocked" if blockers else f"ready_for_{scale}_training", "blockers": blockers,
            "sizes": {"online_tokens": online_tokens, "parity_tokens": parity_tokens},
            "bound_to_this_checkout": {"online": binding(online_receipt), "parity": binding(parity_receipt)}}


def main(online: str, parity: str, *, as_json: bool, online_tokens: int, parity_tokens: int) -> int:
    try:
        record = decide(online, parity, online_tokens=online_tokens, parity_tokens=parity_tokens)
    except BadInput as e:
        print(f"bad input: {e}")
        return 2
    if as_json:
        print(json.dumps(record))
    else:
        print(record["decision"])
        for b in record["blockers"]:
            print(f"  blocker: {b}")
        for name, b in record["bound_to_this_checkout"].items():
            print(f"{name} receipt bound to this checkout: " + ("yes" if b["bound"] else "no (" + "; ".join(b["why"])
                                                                                      + ")"))
    return 1 if record["blockers"] else 0
