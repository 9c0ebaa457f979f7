"""Forgeries a re-sealed receipt used to hide, on the committed online receipt (a real run's): a ground truth forged
with its rewards (caught by `verify --data`: the receipt binds its data file and rows), and a sample's text forged
with its reward (caught by every `verify`: completions, rewards.json, samples.jsonl, the tokens detokenised and
completion_tokens.npy must agree)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from glm52_jax.dapo_data import default_problems_path
from glm52_jax.evidence import verify
from glm52_jax.evidence.__main__ import main
from tests.receipt_forgery import resealed
from tests.run_helpers import ROOT

COMMITTED = ROOT / "evidence" / "online_grpo_tiny.json"
DATA = default_problems_path()


def _rewrite_json(path: Path, edit: Callable[[object], None]) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj, indent=2))


def _rewrite_samples(path: Path, edit: Callable[[dict], None]) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        edit(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _verify(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(["verify", *argv])
    return code, capsys.readouterr().out.splitlines()


def test_the_committed_receipt_binds_its_rows_and_verifies_against_the_shipped_data(capsys):
    receipt = json.loads(COMMITTED.read_text())
    data = receipt["prompt"]["data"]
    assert data["path"] == "glm52_jax/assets/math_problems.jsonl" and data["embedded"] and not data["dedupe"]
    assert data["sha256"] == hashlib.sha256(DATA.read_bytes()).hexdigest()
    first = json.loads(DATA.read_text().splitlines()[0])  # data cursor 0: candidate 0 scored the file's first row
    assert data["rows"][0] == {"candidate": 0, "row": 0, "extra_info_index": first["extra_info"]["index"]}
    code, lines = _verify(capsys, "--data", str(DATA), "--recompute-rewards", str(COMMITTED))
    assert code == 0 and lines[1:] == [
        "OK 2 rewards recomputed with the DAPO rule against the data file's ground truths, all equal to the stored "
        "ones",
        f"OK data file {DATA} is the one the run read (sha256 {data['sha256']}); every scored row and ground truth "
        "re-read from it",
        f"OK sampled texts equal their tokens detokenised with {DATA.parent / 'tokenizer.json'}"], lines


def test_the_committed_parity_receipt_binds_its_rows_too(capsys):
    parity = ROOT / "evidence" / "gradient_parity_tiny.json"
    data = json.loads(parity.read_text())["fixture"]["data"]
    assert data["data_cursor"] == 0 and data["sha256"] == hashlib.sha256(DATA.read_bytes()).hexdigest()
    code, lines = _verify(capsys, "--data", str(DATA), "--recompute-rewards", str(parity))
    assert code == 0 and lines[-1] == (f"OK data file {DATA} is the one the run read (sha256 {data['sha256']}); every "
                                       "scored row and ground truth re-read from it"), lines


def test_a_forged_ground_truth_with_forged_rewards_fails_verify_data(tmp_path, capsys):
    """Candidate 0's ground truth set to sample 1's wrong answer and the rewards flipped to match: every hash
    re-sealed, the reward recomputation (from the receipt's own ground truth) agrees; the data file does not."""
    def forge(receipt, artifacts):
        def edit(candidates):
            candidates[0]["ground_truth"] = candidates[0]["preds"][1]
            candidates[0]["rewards"] = [-1.0, 1.0]
        _rewrite_json(artifacts / "rewards.json", edit)
        receipt["rewards"] = [[-1.0, 1.0]]

    forged = resealed(COMMITTED, tmp_path, forge)
    truth = json.loads(COMMITTED.with_suffix("").joinpath("rewards.json").read_text())[0]["ground_truth"]
    assert verify(forged) == []
    assert _verify(capsys, "--recompute-rewards", str(forged))[0] == 0  # what a re-sealed forgery used to pass
    code, lines = _verify(capsys, "--data", str(DATA), "--recompute-rewards", str(forged))
    where = "online_grpo_tiny/rewards.json: candidate 0"
    assert code == 1 and lines == [
        f"{where}: row 0: ground truth '3', but row 0 of {DATA} has {truth!r}",
        f"{where} sample 0: stored reward -1.0, recomputed 1.0 (pred {truth!r}, ground truth {truth!r})",
        f"{where} sample 1: stored reward 1.0, recomputed -1.0 (pred '3', ground truth {truth!r})"], lines


def test_a_candidate_moved_to_another_row_fails_verify_data(tmp_path, capsys):
    """The scored row swapped for another (its ground truth and index copied too): the data cursor names the row
    the run read."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]

    def forge(receipt, artifacts):
        def edit(candidates):
            candidates[0].update(row=5, ground_truth=rows[5]["reward_model"]["ground_truth"])
        _rewrite_json(artifacts / "rewards.json", edit)
        _rewrite_samples(artifacts / "samples.jsonl", lambda r: r.update(row=5))
        receipt["prompt"]["data"]["rows"][0].update(row=5, extra_info_index=rows[5]["extra_info"]["index"])

    code, lines = _verify(capsys, "--data", str(DATA), str(resealed(COMMITTED, tmp_path, forge)))
    assert code == 1 and lines == ["online_grpo_tiny/rewards.json: candidate 0: scored row 5, but data cursor 0 gives "
                                   f"candidate 0 row 0 of {DATA}"]


def test_a_wrong_or_missing_data_file_is_one_line(tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    other.write_text(DATA.read_text().replace('"ground_truth": "43"', '"ground_truth": "44"', 1))
    digest = hashlib.sha256(other.read_bytes()).hexdigest()
    assert _verify(capsys, "--data", str(other), str(COMMITTED)) == (1, [
        f"--data {other}: sha256 {digest}, but the receipt's data file (glm52_jax/assets/math_problems.jsonl) has "
        f"sha256 {json.loads(COMMITTED.read_text())['prompt']['data']['sha256']}: not the file this run read"])
    missing = tmp_path / "nope.jsonl"
    assert _verify(capsys, "--data", str(missing), str(COMMITTED)) == (2, [
        f"--data {missing}: no such file (the DAPO .jsonl/.parquet file the run read; the shipped problems are "
        "glm52_jax/assets/math_problems.jsonl)"])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"data_source": "x"}\n')
    code, lines = _verify(capsys, "--data", str(broken), str(COMMITTED))
    assert code == 2 and lines == [f"--data {broken}: cannot read its rows: row 0 (broken.jsonl line 1): field "
                                   "'prompt' is missing"]


_TEXTS = "['\\nAnswer: 43', '\\nAnswer: 42']"
_ORIGINAL = "['\\nAnswer: 43', '\\nAnswer: 3']"


@pytest.mark.parametrize("places, expect", [
    # Only the scored text and its reward: the receipt's own completions section and the sampler still show "3".
    (("rewards",), [f"receipt section 'completions': candidate 0 texts {_ORIGINAL} differ from "
                    f"online_grpo_tiny/rewards.json's {_TEXTS}",
                    f"online_grpo_tiny/rewards.json: candidate 0: texts differ from samples.jsonl ({_TEXTS} vs "
                    f"{_ORIGINAL})"]),
    # The completions section too: the raw sampler records still hold the original text.
    (("rewards", "completions"), [f"online_grpo_tiny/rewards.json: candidate 0: texts differ from samples.jsonl "
                                  f"({_TEXTS} vs {_ORIGINAL})"]),
    # The sampler's text too: its tokens still say "3".
    (("rewards", "completions", "samples"), ["online_grpo_tiny/samples.jsonl line 2 (candidate 0 sample 1): text "
                                             "'\\nAnswer: 42', but its tokens detokenise to '\\nAnswer: 3'"]),
])
def test_a_forged_text_with_its_reward_fails_verify(tmp_path, places, expect):
    """Sample 1's wrong answer "3" made "42" in the given places, its reward kept -1 (still wrong against 43): every
    hash re-sealed; the first place left unedited is named."""
    forged_text = "\nAnswer: 42"

    def forge(receipt, artifacts):
        if "rewards" in places:
            _rewrite_json(artifacts / "rewards.json", lambda c: c[0].update(texts=[c[0]["texts"][0], forged_text],
                                                                          preds=[c[0]["preds"][0], "42"]))
        if "completions" in places:
            receipt["completions"][0]["texts"][1] = forged_text
        if "samples" in places:
            _rewrite_samples(artifacts / "samples.jsonl",
                             lambda r: r.update(text=forged_text) if r["sample"] == 1 else None)

    assert verify(resealed(COMMITTED, tmp_path, forge)) == expect


def test_edited_completion_tokens_fail_verify(tmp_path):
    """completion_tokens.npy's first token replaced (same size): the sampler's records still hold the original."""
    def forge(receipt, artifacts):
        path = artifacts / "completion_tokens.npy"
        data = bytearray(path.read_bytes())
        start = len(data) - 2 * 32 * 4  # [2, 32] int32 after the header
        data[start:start + 4] = (7).to_bytes(4, "little")
        path.write_bytes(bytes(data))

    failures = verify(resealed(COMMITTED, tmp_path, forge))
    assert len(failures) == 1 and failures[0].startswith(
        "online_grpo_tiny/completion_tokens.npy: row 0 (candidate 0 sample 0) is [7, "), failures


def test_verify_data_imports_neither_jax_nor_numpy():
    code = ("import sys; from glm52_jax.evidence.__main__ import main; "
            f"assert main(['verify', '--data', {str(DATA)!r}, '--recompute-rewards', {str(COMMITTED)!r}]) == 0; "
            "print(sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"


def test_the_data_cursor_counts_rows_after_dedupe(tmp_path):
    """`data.dedupe`: the cursor walks the de-duplicated rows, a row keeps its file position (rows 0 and 1 repeat
    one prompt, so cursor 1 is file row 2)."""
    from glm52_jax.dapo_data import dapo_record
    from glm52_jax.evidence.data_check import data_failures, read_data_file

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(dapo_record(p, gt, i)) + "\n"
                            for i, (p, gt) in enumerate([("1+1?", 2), ("1+1?", 2), ("2+2?", 4)])))
    data = read_data_file(path)

    def failures(row: int, dedupe: bool) -> list[str]:
        receipt = {"transaction": {"data_cursor": 1},
                   "prompt": {"data": {"sha256": data.sha256, "dedupe": dedupe,
                                       "rows": [{"candidate": 0, "row": row, "extra_info_index": row}]}}}
        candidates = [{"candidate": 0, "row": row, "ground_truth": data.rows[row].ground_truth}]
        return data_failures(receipt, candidates, "rewards.json", data)[0]

    assert failures(2, dedupe=True) == [] and failures(1, dedupe=False) == []
    assert failures(1, dedupe=True) == [f"rewards.json: candidate 0: scored row 1, but data cursor 1 gives candidate 0 "
                                        f"row 2 of {path}"]
