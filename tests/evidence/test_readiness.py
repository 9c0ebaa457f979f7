"""`python -m glm52_jax.evidence readiness`: the seed's ready_for_2m_training decision on the committed tiny
receipts (blocked only by their sizes), re-sealed edits of them (each rule names its blocker), bad input, and
whether a receipt is bound to this checkout."""

from __future__ import annotations

import json
import shutil

import pytest

from glm52_jax.evidence import readiness
from glm52_jax.evidence.__main__ import main
from glm52_jax.evidence.provenance import git_info, source_digest
from tests.receipt_forgery import resealed
from tests.run_helpers import ROOT

ONLINE = ROOT / "evidence" / "online_grpo_tiny.json"
PARITY = ROOT / "evidence" / "gradient_parity_tiny.json"
TINY = ["--online-tokens", "256", "--parity-tokens", "256"]  # the committed receipts' own sizes


def test_the_committed_tiny_receipts_are_blocked_by_their_sizes_only(capsys):
    assert main(["readiness", str(ONLINE), str(PARITY)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["blocked", "  blocker: O2 online: the prompt is 256 tokens, not 2,097,152",
                         "  blocker: P2 parity: the prompt is 256 tokens, fewer than 32,768"]
    commit = json.loads(ONLINE.read_text())["provenance"]["git"]["commit"]  # the commit it was regenerated at
    assert lines[3].startswith(f"online receipt bound to this checkout: no (recorded at commit {commit}")
    assert main(["readiness", str(ONLINE), str(PARITY), *TINY]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "ready_for_256_token_training"


def test_each_rule_names_its_blocker(tmp_path, capsys):
    def online_edit(receipt, _artifacts):
        receipt["training"]["mode"] = "exact"  # B1: a mode the parity receipt never compared
        receipt["training"]["optimizer_steps"] = 2  # O4
        receipt["training"]["advantages"] = [0.0, 0.0]  # O3
        receipt["decode_audit"]["replacement_chars"] = 1  # O6
        receipt["cleanup"]["prefix_cache_cleared"] = False  # O5

    def parity_edit(receipt, _artifacts):
        receipt["parity"]["cases"]["active_clip"]["clipping"]["low"] = 0  # P3
        receipt["parity"]["optimizer_steps"] = 1  # P4

    online = str(resealed(ONLINE, tmp_path / "o", online_edit))
    parity = str(resealed(PARITY, tmp_path / "p", parity_edit))
    assert main(["readiness", online, parity, *TINY, "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["decision"] == "blocked"
    assert [b.split(" ")[0] for b in record["blockers"]] == ["O3", "O4", "O5", "O6", "P3", "P4", "B1"]
    assert record["blockers"][-1] == ("B1 the online update used gradient_mode 'exact', which the parity receipt did "
                                      "not pass (passed: ['conventional', 'response_only', 'shared_prefix'])")


def test_a_tampered_receipt_and_an_edited_verdict_block(tmp_path, capsys):
    online = tmp_path / "o"
    shutil.copytree(ONLINE.with_suffix(""), online / ONLINE.stem)
    text = json.loads(ONLINE.read_text())
    text["rewards"] = [[1.0, 1.0]]  # not re-sealed: O1 (hash), and not what the DAPO rule gives
    (online / ONLINE.name).write_text(json.dumps(text))

    def flip(receipt, _artifacts):
        receipt["parity"]["cases"]["ratio1"]["pairs"]["response_only"]["decision"] = "failed"

    parity = str(resealed(PARITY, tmp_path / "p", flip))
    record = readiness.decide(online / ONLINE.name, parity, online_tokens=256, parity_tokens=256)
    kinds = {b.split(":")[0] for b in record["blockers"]}
    assert {"O1 online", "O1 online rewards", "P1 parity", "B1 the online update used gradient_mode 'response_only', "
            "which the parity receipt did not pass (passed"} <= kinds


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["readiness", str(PARITY), str(PARITY)]) == 2
    assert capsys.readouterr().out == f"bad input: {PARITY}: not an online GRPO receipt (no 'training' section)\n"
    assert main(["readiness", str(ONLINE), str(tmp_path / "none.json")]) == 2


def test_binding_to_this_checkout():
    here = git_info()
    if not here.get("commit"):
        pytest.skip("not a git checkout")
    made_here = {"provenance": {"git": {"commit": here["commit"], "dirty": False}, "source_sha256": source_digest()}}
    assert readiness.binding(made_here) == {"bound": True, "why": []}
    other = {"provenance": {"git": {"commit": "0" * 40, "dirty": True}, "source_sha256": "x"}}
    assert readiness.binding(other)["why"] == [
        f"recorded at commit {'0' * 40}, this checkout is {here['commit']}",
        "recorded from a tree with uncommitted changes (dirty: True)",
        "its package source digest differs from this checkout's files"]
