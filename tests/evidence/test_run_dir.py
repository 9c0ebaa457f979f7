"""`verify WORKDIR`: every committed receipt of a run directory, written by the real receipt code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from glm52_jax.evidence import EvidenceWriter
from glm52_jax.evidence.__main__ import main
from glm52_jax.evidence.run_dir import find_receipts

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = {"source_sha256": "0" * 64, "source_files": 0, "git": {"commit": None, "dirty": None}, "packages": {}}


@pytest.fixture
def workdir(tmp_path):
    """A run's workdir as rl/run.py and rl/parity.py leave it: two committed steps, a set-aside step, a step
    killed before its receipt, a named parity receipt, and the files beside the evidence."""
    run = tmp_path / "run"
    evidence = run / "evidence"
    for step in (1, 2):
        w = EvidenceWriter(evidence / f"step_{step:06d}", provenance=PROVENANCE)
        w.add_json("rewards.json", [step], kind="rewards")
        w.add_bytes("samples.jsonl", b"{}\n" * step, kind="samples")
        w.commit({"transaction": {"step": step}})
    aside = EvidenceWriter(evidence / "step_000003.uncommitted-1", provenance=PROVENANCE)
    aside.add_bytes("partial.bin", b"x", kind="partial")
    (evidence / "step_000004" / "artifacts").mkdir(parents=True)
    named = EvidenceWriter(evidence, provenance=PROVENANCE, receipt_name="gradient_parity_tiny.json")
    named.add_json("candidates.json", [], kind="fixture")
    named.commit({"parity": {"decision": "passed"}})
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    return run


def test_finds_every_committed_receipt_and_names_the_rest(workdir):
    evidence = workdir / "evidence"
    found = find_receipts(workdir)
    assert not found.single and found.receipts == [evidence / "gradient_parity_tiny.json",
                                                   evidence / "step_000001" / "receipt.json",
                                                   evidence / "step_000002" / "receipt.json"]
    assert found.unverified == [(evidence / "step_000003.uncommitted-1", "not a committed step"),
                                (evidence / "step_000004", "no receipt.json: the step did not commit")]
    assert find_receipts(evidence) == found  # the evidence directory itself
    step = evidence / "step_000001"
    assert find_receipts(step) == find_receipts(step / "receipt.json")
    assert find_receipts(step).receipts == [step / "receipt.json"] and find_receipts(step).single


def test_cli_verifies_a_run_and_names_the_failing_receipt(workdir, capsys):
    assert main(["verify", str(workdir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in lines[:3]] == ["evidence/gradient_parity_tiny.json",
                                                           "evidence/step_000001/receipt.json",
                                                           "evidence/step_000002/receipt.json"]
    assert all(": OK 2 artifacts, manifest " in line for line in lines[1:3]), lines
    assert lines[3:] == ["evidence/step_000003.uncommitted-1: not verified (not a committed step)",
                         "evidence/step_000004: not verified (no receipt.json: the step did not commit)",
                         "OK: 3 of 3 receipts verified"]

    artifact = workdir / "evidence" / "step_000002" / "artifacts" / "samples.jsonl"
    artifact.write_bytes(b"{}\n{}}")  # same size, other bytes
    assert main(["verify", "--json", str(workdir)]) == 1
    record = json.loads(capsys.readouterr().out)
    assert not record["ok"] and [r["ok"] for r in record["receipts"]] == [True, True, False]
    failures = record["receipts"][2]["failures"]
    assert len(failures) == 1 and failures[0].startswith("artifact sha256 mismatch: artifacts/samples.jsonl"), failures
    assert record["not_verified"][1] == {"path": "evidence/step_000004", "why": "no receipt.json: the step did not "
                                                                                "commit"}
    # The process: exit 1, the failing receipt named on its line, the tally last.
    done = subprocess.run([sys.executable, "-m", "glm52_jax.evidence", "verify", str(workdir)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    out = done.stdout.splitlines()
    assert done.returncode == 1 and out[-1] == "FAILED: 2 of 3 receipts verified", done.stdout + done.stderr
    assert out[2].startswith("evidence/step_000002/receipt.json: artifact sha256 mismatch: artifacts/samples.jsonl")


def test_a_directory_without_receipts_fails(tmp_path, capsys):
    (tmp_path / "evidence" / "step_000001").mkdir(parents=True)
    assert main(["verify", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "evidence/step_000001: not verified (no receipt.json: the step did not commit)",
        f"FAILED: no receipt under {tmp_path} (a receipt.json, its directory, or a run's workdir)"]
