"""`verify` decides a parity receipt's pairs again from their stored metrics (`evidence/parity_check.py`): the
committed receipt's 12 pairs (both cases: the modes, the HF + PEFT and the megatron-core references) agree, and a
re-sealed receipt whose verdict was edited, or whose metrics were, fails with a line naming the pair."""

from __future__ import annotations

import copy
import json

from glm52_jax.evidence.__main__ import main
from glm52_jax.evidence.parity_check import parity_decision_failures
from tests.receipt_forgery import resealed
from tests.run_helpers import ROOT

COMMITTED = ROOT / "evidence" / "gradient_parity_tiny.json"


def test_the_committed_receipts_decisions_follow_from_its_metrics(capsys):
    receipt = json.loads(COMMITTED.read_text())
    assert parity_decision_failures(receipt) == ([], 12)
    assert {g for c in receipt["parity"]["cases"].values() for g in c} == {"clipping", "modes", "pairs", "torch",
                                                                          "megatron"}
    assert main(["verify", str(COMMITTED)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == ("OK 12 parity decisions recomputed from their metrics and "
                                                       "bounds, all equal to the stored ones")
    assert parity_decision_failures(json.loads((ROOT / "evidence" / "online_grpo_tiny.json").read_text())) == ([], 0)


def test_an_edited_verdict_fails_verify(tmp_path, capsys):
    def flip(receipt, _artifacts):
        receipt["parity"]["cases"]["active_clip"]["megatron"]["response_only"]["decision"] = "failed"

    assert main(["verify", str(resealed(COMMITTED, tmp_path, flip))]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "parity.cases.active_clip.megatron.response_only: the stored decision 'failed' does not follow from its "
        "metrics and bounds (recomputed: 'passed')"]


def test_edited_metrics_fail_the_pair_and_the_verdict():
    receipt = json.loads(COMMITTED.read_text())
    worse = copy.deepcopy(receipt)
    worse["parity"]["cases"]["ratio1"]["megatron"]["conventional"]["families"]["all"]["rel_l2"] = 2e-5  # > 1e-5
    failures, n = parity_decision_failures(worse)
    assert n == 12 and failures == [
        "parity.cases.ratio1.megatron.conventional: the stored decision 'passed' does not follow from its metrics and "
        "bounds (recomputed: 'failed')", "parity.decision is 'passed' but its pairs give 'failed'"]
