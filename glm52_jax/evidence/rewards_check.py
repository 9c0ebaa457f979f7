"""Independent reward recomputation: every stored reward of a receipt, recomputed from its stored texts.

    python -m glm52_jax.evidence verify --recompute-rewards RECEIPT

The hashes bind the files to the receipt, but a forger who edits a reward can re-seal them (new
artifact sha256, manifest_sha256, receipt_sha256). This check does not trust the stored numbers:
each artifact of kind "rewards" (a transaction's `rewards.json`, a parity run's `candidates.json`:
one record per candidate with "texts", "ground_truth", "rewards", "preds") is re-scored with the
project's DAPO rule (`rl.rewards.dapo.compute_score`, default Minerva mode, as the run scores, with the
`boxed_fallback` setting of the receipt's "reward_rule" section; a receipt from before that section
was scored without the fallback), and compared with the stored rewards and predictions, with the
receipt's "rewards" section, and with the raw sampler texts of `samples.jsonl` when the receipt has one.

The reward module is imported when the check runs; it needs only the standard library, so the
evidence package still starts without JAX or numpy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from glm52_jax.evidence.receipt import EvidenceError, load_receipt, receipt_file
from glm52_jax.evidence.text_refs import REWARDS_KIND, SAMPLES_KIND, cross_checks

RULE_SECTION = "reward_rule"
_CANDIDATE_KEYS = ("candidate", "texts", "ground_truth", "rewards", "preds")


def artifacts_of_kind(receipt: Mapping[str, Any], kind: str) -> list[str]:
    manifest = receipt.get("manifest")
    return [e["path"] for e in manifest if isinstance(e, dict) and e.get("kind") == kind] \
        if isinstance(manifest, list) else []


def read_artifact_json(run_dir: Path, path: str) -> Any:
    try:
        return json.loads((run_dir / PurePosixPath(path)).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EvidenceError(f"{path}: cannot read it as JSON ({e})") from None


def _candidate_problem(cd: Any) -> str | None:
    if not isinstance(cd, dict) or any(k not in cd for k in _CANDIDATE_KEYS):
        return f"expected an object with keys {list(_CANDIDATE_KEYS)}"
    n = len(cd["texts"]) if isinstance(cd["texts"], list) else -1
    if n < 0 or not all(isinstance(t, str) for t in cd["texts"]) or not isinstance(cd["ground_truth"], str):
        return "'texts' must be a list of strings and 'ground_truth' a string"
    if not isinstance(cd["rewards"], list) or len(cd["rewards"]) != n or not isinstance(cd["preds"], list) \
            or len(cd["preds"]) != n:
        return f"'rewards' and 'preds' must be lists of {n} entries (one per text)"
    return None


def boxed_fallback_of(receipt: Mapping[str, Any]) -> bool | str:
    """The `boxed_fallback` setting the receipt's samples were scored with, or why it cannot be read.
    No "reward_rule" section: False (the receipts written before the setting existed)."""
    rule = receipt.get(RULE_SECTION)
    if rule is None:
        return False
    if not isinstance(rule, dict) or not isinstance(rule.get("boxed_fallback"), bool):
        return f"receipt section {RULE_SECTION!r} must be an object with a true/false 'boxed_fallback', got {rule!r}"
    return rule["boxed_fallback"]


def recompute_candidates(path: str, candidates: Any, *, boxed_fallback: bool = False,
                         ground_truths: Mapping[int, str] | None = None) -> tuple[list[str], int]:
    """(a line per difference, rewards recomputed) for one rewards artifact's candidate records. `ground_truths`
    ({row position: ground truth}, from the data file: `verify --data`) replaces each record's stored ground
    truth when given."""
    from glm52_jax.rl.rewards.dapo import compute_score

    if not isinstance(candidates, list):
        return [f"{path}: expected a list of candidate records"], 0
    failures, count = [], 0
    for i, cd in enumerate(candidates):
        problem = _candidate_problem(cd)
        if problem:
            failures.append(f"{path}: record {i} is malformed: {problem}")
            continue
        truth = cd["ground_truth"] if ground_truths is None else ground_truths.get(cd.get("row"), cd["ground_truth"])
        for j, text in enumerate(cd["texts"]):
            score = compute_score(text, truth, boxed_fallback=boxed_fallback)
            count += 1
            where = f"{path}: candidate {cd['candidate']} sample {j}"
            if cd["rewards"][j] != score["score"]:
                failures.append(f"{where}: stored reward {cd['rewards'][j]!r}, recomputed {score['score']!r} "
                                f"(pred {score['pred']!r}, ground truth {truth!r})")
            if cd["preds"][j] != score["pred"]:
                failures.append(f"{where}: stored pred {cd['preds'][j]!r}, recomputed {score['pred']!r}")
    return failures, count


def read_sample_texts(run_dir: Path, paths: Sequence[str]) -> tuple[dict | None, list[str]]:
    """{candidate: [text of sample 0, 1, ...]} from the candidate requests of `samples.jsonl`."""
    if not paths:
        return None, []
    texts: dict[Any, dict[int, str]] = {}
    try:
        for line in (run_dir / PurePosixPath(paths[0])).read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("request") == "candidate":
                texts.setdefault(record["candidate"], {})[record["sample"]] = record["text"]
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return None, [f"{paths[0]}: cannot read the sampler records ({type(e).__name__}: {e})"]
    return {c: [by_sample[j] for j in sorted(by_sample)] for c, by_sample in texts.items()}, []


def recompute_rewards(receipt_path: str | Path, *, ground_truths: Mapping[int, str] | None = None
                      ) -> tuple[list[str], int]:
    """(a line per difference, rewards recomputed) over every rewards artifact of the receipt; `ground_truths`
    as in `recompute_candidates`.

    A receipt without a rewards artifact is a failure (there is nothing to recompute). Hashes are
    not checked here: `receipt.verify` does that.
    """
    receipt_path = receipt_file(receipt_path)
    try:
        receipt = load_receipt(receipt_path)
    except EvidenceError as e:
        return [str(e)], 0
    run_dir = receipt_path.parent
    paths = artifacts_of_kind(receipt, REWARDS_KIND)
    if not paths:
        return [f"{receipt_path}: no artifact of kind {REWARDS_KIND!r} to recompute"], 0
    boxed_fallback = boxed_fallback_of(receipt)
    if isinstance(boxed_fallback, str):
        return [f"{receipt_path}: {boxed_fallback}"], 0
    raw_texts, failures = read_sample_texts(run_dir, artifacts_of_kind(receipt, SAMPLES_KIND))
    total = 0
    for path in paths:
        try:
            candidates = read_artifact_json(run_dir, path)
        except EvidenceError as e:
            failures.append(str(e))
            continue
        lines, count = recompute_candidates(path, candidates, boxed_fallback=boxed_fallback,
                                            ground_truths=ground_truths)
        failures += lines
        total += count
        if isinstance(candidates, list):
            failures += cross_checks(receipt, path, candidates, raw_texts)
    return failures, total
