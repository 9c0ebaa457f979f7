"""Reward recomputation on hand-made receipts (real files): each kind of difference is one named line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from glm52_jax.evidence import EvidenceWriter
from glm52_jax.evidence.rewards_check import recompute_rewards

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = {"source_sha256": "0" * 64, "source_files": 0, "git": {"commit": None, "dirty": None}, "packages": {}}
TEXTS = [["so 2+2 = 4.\nAnswer: 4", "Answer: 5"], ["Answer: 12", "Answer: 12."]]


def _candidates():
    # Minerva mode keeps trailing punctuation: "12." is not "12".
    return [{"candidate": 0, "row": 3, "ground_truth": "4", "texts": TEXTS[0], "rewards": [1.0, -1.0],
             "preds": ["4", "5"]},
            {"candidate": 1, "row": 4, "ground_truth": "12", "texts": TEXTS[1], "rewards": [1.0, -1.0],
             "preds": ["12", "12."]}]


def _write(run: Path, candidates=None, section=None, samples=None) -> Path:
    candidates = _candidates() if candidates is None else candidates
    samples = [{"request": "candidate", "candidate": c, "sample": j, "text": t}
               for c, texts in enumerate(TEXTS) for j, t in enumerate(texts)] if samples is None else samples
    w = EvidenceWriter(run, provenance=PROVENANCE)
    w.add_json("rewards.json", candidates, kind="rewards")
    w.add_bytes("samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples).encode(), kind="samples")
    return w.commit({"rewards": [cd["rewards"] for cd in candidates] if section is None else section})


def test_consistent_receipt_recomputes_every_reward(tmp_path):
    assert recompute_rewards(_write(tmp_path / "run")) == ([], 4)
    assert recompute_rewards(tmp_path / "run") == ([], 4)  # the run directory works too


def test_each_difference_is_one_line(tmp_path):
    cands = _candidates()
    cands[1]["rewards"][1] = 1.0
    cands[0]["preds"][1] = "4"
    failures, n = recompute_rewards(_write(tmp_path / "a", cands, section=[[1.0, -1.0], [1.0, -1.0]]))
    assert n == 4 and failures == [
        "artifacts/rewards.json: candidate 0 sample 1: stored pred '4', recomputed '5'",
        "artifacts/rewards.json: candidate 1 sample 1: stored reward 1.0, recomputed -1.0 (pred '12.', "
        "ground truth '12')",
        "receipt section 'rewards' [[1.0, -1.0], [1.0, -1.0]] differs from the rewards in artifacts/rewards.json",
    ]
    samples = [{"request": "candidate", "candidate": 0, "sample": j, "text": t} for j, t in enumerate(TEXTS[0])]
    samples += [{"request": "candidate", "candidate": 1, "sample": 0, "text": "Answer: 13"},
                {"request": "probe", "candidate": None, "sample": 0, "text": "ignored"}]
    failures, _ = recompute_rewards(_write(tmp_path / "b", samples=samples))
    assert failures == ["artifacts/rewards.json: candidate 1: texts differ from samples.jsonl "
                        "(['Answer: 12', 'Answer: 12.'] vs ['Answer: 13'])"]


@pytest.mark.parametrize("candidates, expect", [
    ([{"candidate": 0, "texts": ["Answer: 1"], "ground_truth": "1", "rewards": [1.0]}], "record 0 is malformed"),
    ([{"candidate": 0, "texts": ["Answer: 1"], "ground_truth": "1", "rewards": [1.0, 1.0], "preds": ["1"]}],
     "lists of 1 entries"),
    ({"candidate": 0}, "expected a list of candidate records"),
])
def test_malformed_rewards_are_named(tmp_path, candidates, expect):
    failures, _ = recompute_rewards(_write(tmp_path / "run", candidates, section=[], samples=[]))
    assert failures and expect in failures[0], failures


def test_receipt_without_rewards_fails(tmp_path):
    w = EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    w.add_json("other.json", [], kind="other")
    failures, n = recompute_rewards(w.commit({}))
    assert n == 0 and failures == [f"{tmp_path / 'run' / 'receipt.json'}: no artifact of kind 'rewards' to recompute"]


def test_recomputation_imports_neither_jax_nor_numpy(tmp_path):
    receipt = _write(tmp_path / "run")
    code = ("import sys, types; pkg = types.ModuleType('glm52_jax'); pkg.__path__ = ['glm52_jax']; "
            "sys.modules['glm52_jax'] = pkg; from glm52_jax.evidence.rewards_check import recompute_rewards; "
            f"assert recompute_rewards({str(receipt)!r}) == ([], 4); "
            "print(sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_flag_text_and_json(tmp_path, capsys):
    from glm52_jax.evidence.__main__ import main

    good = _write(tmp_path / "good")
    assert main(["verify", "--recompute-rewards", str(good)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("OK 2 artifacts, manifest ")
    assert lines[1] == "OK 4 rewards recomputed with the DAPO rule, all equal to the stored ones"
    cands = _candidates()
    cands[0]["rewards"][0] = -1.0
    bad = _write(tmp_path / "bad", cands)  # written by the writer: every hash is valid
    assert main(["verify", str(bad)]) == 0
    capsys.readouterr()
    assert main(["verify", "--json", "--recompute-rewards", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["rewards_recomputed"] == 4 and out["failures"] == [
        "artifacts/rewards.json: candidate 0 sample 0: stored reward -1.0, recomputed 1.0 (pred '4', ground truth '4')"]


def test_recomputation_uses_the_recorded_boxed_fallback(tmp_path):
    """A receipt's "reward_rule" section sets the rule the rewards are recomputed with: box-only answers score
    +1 / -1 under boxed_fallback=True and are "[INVALID]" without it; a malformed section is one line."""
    from glm52_jax.rl.rewards.dapo import reward_rule

    texts = [["so \\boxed{4}", "so \\boxed{5}"]]
    scored = [{"candidate": 0, "row": 3, "ground_truth": "4", "texts": texts[0], "rewards": [1.0, -1.0],
               "preds": ["4", "5"]}]
    samples = [{"request": "candidate", "candidate": 0, "sample": j, "text": t} for j, t in enumerate(texts[0])]

    def write(run: Path, rule) -> Path:
        w = EvidenceWriter(run, provenance=PROVENANCE)
        w.add_json("rewards.json", scored, kind="rewards")
        w.add_bytes("samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples).encode(), kind="samples")
        return w.commit({"rewards": [scored[0]["rewards"]], **({} if rule is None else {"reward_rule": rule})})

    assert recompute_rewards(write(tmp_path / "on", reward_rule(True))) == ([], 2)
    failures, n = recompute_rewards(write(tmp_path / "off", reward_rule(False)))
    assert n == 2 and failures == [
        "artifacts/rewards.json: candidate 0 sample 0: stored reward 1.0, recomputed -1.0 (pred '[INVALID]', "
        "ground truth '4')",
        "artifacts/rewards.json: candidate 0 sample 0: stored pred '4', recomputed '[INVALID]'",
        "artifacts/rewards.json: candidate 0 sample 1: stored pred '5', recomputed '[INVALID]'"]
    assert recompute_rewards(write(tmp_path / "old", None))[0] == failures  # no section: the seed's rule
    bad = write(tmp_path / "bad", {"boxed_fallback": "yes"})
    assert recompute_rewards(bad) == ([f"{bad}: receipt section 'reward_rule' must be an object with a true/false "
                                       "'boxed_fallback', got {'boxed_fallback': 'yes'}"], 0)
