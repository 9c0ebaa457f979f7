"""Evidence writer, verifier, deterministic view and CLI, on real files (no mocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glm52_jax.evidence import EvidenceError, EvidenceWriter, canonical_sha256, deterministic_view, load_receipt, verify
from glm52_jax.evidence.__main__ import main

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = {"source_sha256": "0" * 64, "source_files": 0, "git": {"commit": None, "dirty": None}, "packages": {}}
FIELDS = {
    "prompt": {"id": "p-7", "text": "What is 6*7?"},
    "rewards": {"scores": [1.0, 0.0, 1.0, 0.5]},
    "numerics": {"loss": 0.25, "grad_norm": "nan"},  # non-finite values are recorded as strings
    "traces": {"wall_s": 1.25},
    "nondeterministic": ["traces", "artifacts/timing.json"],
}
ARTIFACTS = ["artifacts/completions.json", "artifacts/logprobs/old.npy", "artifacts/raw.bin",
             "artifacts/source_copy.txt", "artifacts/timing.json"]


def _write_run(run_dir: Path, *, fields=FIELDS, wall_s=1.25, provenance=PROVENANCE) -> Path:
    src = run_dir.parent / f"{run_dir.name}-source.txt"
    src.write_text("copied verbatim\n" * 100)
    w = EvidenceWriter(run_dir, provenance=provenance)
    w.add_json("completions.json", [{"text": "42", "reward": 1.0}, {"text": "41", "reward": 0.0}], "completions")
    w.add_array("logprobs/old.npy", np.linspace(-3, 0, 12, dtype=np.float32).reshape(3, 4), "logprobs")
    w.add_bytes("raw.bin", bytes(range(256)), "trace")
    w.add_file("source_copy.txt", src, "copy")
    w.add_json("timing.json", {"wall_s": wall_s}, "timing")
    return w.commit({**fields, "traces": {"wall_s": wall_s}})


@pytest.fixture
def receipt(tmp_path) -> Path:
    return _write_run(tmp_path / "run")


def _rehash(receipt: dict) -> dict:
    """Recompute both hashes, as a forger would, so that a check other than the hashes must fire."""
    receipt = {k: v for k, v in receipt.items() if k != "receipt_sha256"}
    receipt["manifest_sha256"] = canonical_sha256(receipt["manifest"])
    receipt["receipt_sha256"] = canonical_sha256(receipt)
    return receipt


def _save(path: Path, receipt: dict) -> None:
    path.write_text(json.dumps(receipt, indent=2))


def test_written_run_verifies(receipt):
    assert verify(receipt) == []
    assert verify(receipt.parent) == []  # the run directory works too
    r = load_receipt(receipt)
    assert [e["path"] for e in r["manifest"]] == ARTIFACTS
    assert r["schema"] == "glm52-jax/evidence" and r["version"] == 1
    assert r["prompt"] == FIELDS["prompt"] and r["provenance"] == PROVENANCE
    assert list(r)[-3:] == ["manifest", "manifest_sha256", "receipt_sha256"]
    old = np.load(receipt.parent / "artifacts/logprobs/old.npy")
    assert old.dtype == np.float32 and old.shape == (3, 4)
    assert not [p for p in receipt.parent.rglob("*.tmp")]


def test_flipping_any_byte_names_exactly_that_artifact(receipt):
    for rel in ARTIFACTS:
        path = receipt.parent / rel
        original = path.read_bytes()
        for offset in (0, len(original) // 2, len(original) - 1):
            tampered = bytearray(original)
            tampered[offset] ^= 0x01
            path.write_bytes(bytes(tampered))
            failures = verify(receipt)
            assert len(failures) == 1, failures
            assert f"sha256 mismatch: {rel} " in failures[0]
        path.write_bytes(original)
    assert verify(receipt) == []


def test_truncated_artifact_is_a_size_mismatch(receipt):
    path = receipt.parent / "artifacts/raw.bin"
    path.write_bytes(path.read_bytes()[:-1])
    assert verify(receipt) == ["artifact size mismatch: artifacts/raw.bin has 255 bytes, manifest says 256"]


def test_editing_receipt_value_is_detected_but_reformatting_is_not(receipt):
    r = load_receipt(receipt)
    receipt.write_text(json.dumps(r, indent=7, sort_keys=True))  # same content, other layout
    assert verify(receipt) == []
    r["rewards"]["scores"][1] = 1.0
    _save(receipt, r)
    failures = verify(receipt)
    assert len(failures) == 1 and failures[0].startswith("receipt.json was modified")


def test_editing_manifest_entry_breaks_both_hashes(receipt):
    r = load_receipt(receipt)
    r["manifest"][2]["kind"] = "other"
    _save(receipt, r)
    failures = verify(receipt)
    assert failures[0].startswith("receipt.json was modified")
    assert failures[1].startswith("manifest_sha256 mismatch")
    assert len(failures) == 2


def test_missing_artifact_named(receipt):
    (receipt.parent / "artifacts/logprobs/old.npy").unlink()
    assert verify(receipt) == ["artifact missing: artifacts/logprobs/old.npy"]


def test_stray_files_named(receipt):
    (receipt.parent / "artifacts/stray.txt").write_text("x")
    (receipt.parent / "artifacts/logprobs/.old.npy.abc.tmp").write_bytes(b"")  # a crashed writer's temp file
    (receipt.parent / "notes.md").write_text("outside artifacts/ is not evidence")
    assert verify(receipt) == ["unexpected file not in the manifest: artifacts/logprobs/.old.npy.abc.tmp",
                               "unexpected file not in the manifest: artifacts/stray.txt"]


def test_manifest_path_escaping_run_dir_named(receipt):
    r = load_receipt(receipt)
    r["manifest"][2]["path"] = "artifacts/../receipt.json"
    _save(receipt, _rehash(r))
    failures = verify(receipt)
    assert failures == ["manifest entry 2 is malformed: path 'artifacts/../receipt.json' must not contain '..' "
                        "(escapes the run directory)",
                        "unexpected file not in the manifest: artifacts/raw.bin"]


@pytest.mark.parametrize("bad_path, expect", [
    ("/etc/passwd", "must be relative"),
    ("receipt.json", "is not under artifacts/"),
    ("artifacts\\raw.bin", "backslashes"),
    ("artifacts//raw.bin", "empty or '.' components"),
])
def test_bad_manifest_paths_named(receipt, bad_path, expect):
    r = load_receipt(receipt)
    r["manifest"][2]["path"] = bad_path
    _save(receipt, _rehash(r))
    failures = verify(receipt)
    assert expect in failures[0] and "manifest entry 2" in failures[0]


def test_symlinked_artifact_rejected(receipt, tmp_path):
    target = receipt.parent / "artifacts/raw.bin"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    assert verify(receipt) == ["artifact artifacts/raw.bin is a symlink, not a regular file"]


def test_unreadable_or_foreign_receipts(tmp_path, receipt):
    assert "cannot read receipt" in verify(tmp_path / "nope.json")[0]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "is not valid JSON" in verify(bad)[0]
    bad.write_text('{"a": NaN}')
    assert "non-standard JSON constant NaN" in verify(bad)[0]
    bad.write_text('{"a": 1, "a": 2}')
    assert "duplicate key" in verify(bad)[0]
    bad.write_text("[1, 2]")
    assert "is not a JSON object" in verify(bad)[0]
    r = load_receipt(receipt)
    r["version"] = 2
    _save(receipt, _rehash(r))
    assert verify(receipt) == ["unsupported receipt: schema 'glm52-jax/evidence' version 2 "
                               "(expected 'glm52-jax/evidence' version 1)"]


def test_refuses_to_overwrite_committed_receipt(receipt):
    before = receipt.read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite committed evidence"):
        EvidenceWriter(receipt.parent, provenance=PROVENANCE)
    assert receipt.read_bytes() == before


def test_refuses_leftovers_and_double_commit(tmp_path):
    w = EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    w.add_bytes("a.bin", b"a", "x")
    with pytest.raises(EvidenceError, match="from an uncommitted run"):  # aborted run left artifacts behind
        EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    w.commit({})
    with pytest.raises(EvidenceError, match="already committed"):
        w.commit({})
    with pytest.raises(EvidenceError, match="already committed"):
        w.add_bytes("b.bin", b"b", "x")


@pytest.mark.parametrize("name, expect", [
    ("/abs.bin", "must be relative"), ("../up.bin", "'..'"), ("a/../b.bin", "'..'"), ("a\\b.bin", "backslashes"),
    ("", "non-empty"), ("a//b.bin", "empty or '.'"), ("./a.bin", "empty or '.'"), ("dir/", "empty or '.'"),
])
def test_bad_artifact_names_rejected(tmp_path, name, expect):
    w = EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    with pytest.raises(EvidenceError, match=expect):
        w.add_bytes(name, b"x", "x")
    assert not list((tmp_path / "run" / "artifacts").rglob("*"))


def test_duplicate_and_conflicting_names_rejected(tmp_path):
    w = EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    w.add_bytes("a", b"x", "x")
    with pytest.raises(EvidenceError, match="already added"):
        w.add_bytes("a", b"y", "x")
    with pytest.raises(EvidenceError, match="file vs directory"):
        w.add_bytes("a/b", b"y", "x")
    with pytest.raises(EvidenceError, match="must end in '.npy'"):
        w.add_array("arr.bin", np.zeros(2), "x")
    with pytest.raises(EvidenceError, match="kind must be"):
        w.add_bytes("k", b"x", "")
    assert (tmp_path / "run/artifacts/a").read_bytes() == b"x"
    w.commit({})
    assert verify(tmp_path / "run") == []


@pytest.mark.parametrize("fields, expect", [
    ({"numerics": {"loss": [0.5, float("nan")]}}, r"numerics\.loss\[1\]: non-finite float nan"),
    ({"training": {"lr": float("inf")}}, r"training\.lr: non-finite float inf"),
    ({"model": {"dtype": np.float32(1)}}, r"model\.dtype: float32 is not JSON data"),
    ({"manifest": []}, r"\['manifest'\] are reserved"),
    ({"receipt_sha256": "x", "schema": "y"}, r"\['receipt_sha256', 'schema'\] are reserved"),
    ({"nondeterministic": ["nope"]}, r"names \['nope'\], which are neither"),
])
def test_bad_fields_rejected_and_nothing_committed(tmp_path, fields, expect):
    w = EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    w.add_bytes("a.bin", b"x", "x")
    with pytest.raises(EvidenceError, match=expect):
        w.commit(fields)
    assert not (tmp_path / "run/receipt.json").exists()
    w.commit({"numerics": {"loss": "nan"}})  # the corrected commit goes through
    assert verify(tmp_path / "run") == []


def test_commit_refuses_stray_artifact(tmp_path):
    w = EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    (tmp_path / "run/artifacts/sneaky.bin").write_bytes(b"x")
    with pytest.raises(EvidenceError, match="not added through the writer"):
        w.commit({})
    assert not (tmp_path / "run/receipt.json").exists()


def test_artifacts_are_deterministic(tmp_path):
    a = EvidenceWriter(tmp_path / "a", provenance=PROVENANCE)
    b = EvidenceWriter(tmp_path / "b", provenance=PROVENANCE)
    values = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert a.add_array("x.npy", values, "x") == b.add_array("x.npy", np.asfortranarray(values), "x")
    assert a.add_json("j.json", {"b": 1, "a": 2}, "x") == b.add_json("j.json", {"a": 2, "b": 1}, "x")


def test_default_provenance_is_real(tmp_path):
    r = load_receipt(EvidenceWriter(tmp_path / "run").commit({}))
    assert len(r["provenance"]["source_sha256"]) == 64 and r["provenance"]["packages"]["numpy"] == np.__version__
    assert r["manifest"] == [] and verify(tmp_path / "run") == []


def test_deterministic_view_compares_runs(tmp_path):
    first = _write_run(tmp_path / "one", wall_s=1.25)
    other_prov = {**PROVENANCE, "packages": {"python": "other"}}
    second = _write_run(tmp_path / "two", wall_s=9.5, provenance=other_prov)
    assert load_receipt(first)["receipt_sha256"] != load_receipt(second)["receipt_sha256"]
    assert deterministic_view(first) == deterministic_view(load_receipt(second))
    view = deterministic_view(first)
    assert "traces" not in view and "created_utc" not in view and "provenance" not in view
    assert "artifacts/timing.json" not in [e["path"] for e in view["manifest"]]

    changed = _write_run(tmp_path / "three", fields={**FIELDS, "rewards": {"scores": [0.0]}})
    assert deterministic_view(changed) != deterministic_view(first)


def test_cli_json_and_show(receipt, capsys):
    assert main(["verify", "--json", str(receipt)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["artifacts"] == len(ARTIFACTS) and out["failures"] == []
    assert out["manifest_sha256"] == load_receipt(receipt)["manifest_sha256"]

    assert main(["show", str(receipt.parent)]) == 0
    shown = capsys.readouterr().out
    assert "glm52-jax/evidence v1" in shown and "artifacts/logprobs/old.npy" in shown
    assert "sections  prompt, rewards, numerics, traces" in shown

    (receipt.parent / "artifacts/raw.bin").unlink()
    assert main(["verify", "--json", str(receipt)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["failures"] == ["artifact missing: artifacts/raw.bin"]
    for argv in (["verify"], ["frobnicate", str(receipt)], []):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


def test_cli_subprocess_exit_codes(tmp_path):
    good = _write_run(tmp_path / "good")
    bad = _write_run(tmp_path / "bad")
    (bad.parent / "artifacts/timing.json").write_text("{}")
    (bad.parent / "artifacts/extra").write_text("x")
    commands = {"ok": ["verify", str(good)], "fail": ["verify", str(bad)], "usage": ["verify"]}
    # Started together: each interpreter imports the whole package (jax included), so overlap them.
    procs = {k: subprocess.Popen([sys.executable, "-m", "glm52_jax.evidence", *args], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
             for k, args in commands.items()}
    results = {k: (p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for k, p in procs.items()}
    for p in procs.values():
        p.stdout.close()
        p.stderr.close()

    rc, out, _ = results["ok"]
    assert rc == 0 and out == f"OK {len(ARTIFACTS)} artifacts, manifest {load_receipt(good)['manifest_sha256']}\n"
    rc, out, _ = results["fail"]
    assert rc == 1
    assert out.splitlines() == [f"artifact size mismatch: artifacts/timing.json has 2 bytes, manifest says "
                                f"{load_receipt(bad)['manifest'][-1]['bytes']}",
                                "unexpected file not in the manifest: artifacts/extra"]
    rc, _, err = results["usage"]
    assert rc == 2 and "usage:" in err


def test_evidence_modules_import_neither_jax_nor_numpy():
    # The parent package's __init__ imports jax; stand it in with a bare namespace so that only the
    # evidence modules' own imports are measured.
    code = ("import sys, types; pkg = types.ModuleType('glm52_jax'); pkg.__path__ = ['glm52_jax']; "
            "sys.modules['glm52_jax'] = pkg; import glm52_jax.evidence, glm52_jax.evidence.__main__; "
            "print(sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_file_written_by_another_process_is_listed_with_its_hash(tmp_path):
    import hashlib

    from glm52_jax.evidence import atomic_write_bytes

    writer = EvidenceWriter(tmp_path / "run", provenance=PROVENANCE)
    other = tmp_path / "run" / "artifacts" / "traces" / "rank1.jsonl"
    other.parent.mkdir(parents=True)
    atomic_write_bytes(other, b'{"event": "step_done"}\n', overwrite=False)  # as process 1 writes it
    entry = writer.add_written("traces/rank1.jsonl", kind="trace")
    assert entry == {"path": "artifacts/traces/rank1.jsonl", "kind": "trace", "bytes": 23,
                     "sha256": hashlib.sha256(b'{"event": "step_done"}\n').hexdigest()}
    with pytest.raises(EvidenceError, match="rank2.jsonl.*not a regular file"):
        writer.add_written("traces/rank2.jsonl", kind="trace")  # never written
    receipt = writer.commit({})
    assert verify(receipt) == []
    other.write_bytes(b"edited\n")
    assert any("traces/rank1.jsonl" in failure for failure in verify(receipt))


def test_named_receipts_share_a_directory_and_verify_apart(tmp_path):
    """Two named receipts (as the seed names them) in one evidence/ directory: each lists only its own
    artifacts directory, a stray in one does not fail the other, and a bad name is refused."""
    evidence = tmp_path / "evidence"
    paths = {}
    for name in ("gradient_parity_32k.json", "online_grpo_2m.json"):
        w = EvidenceWriter(evidence, provenance=PROVENANCE, receipt_name=name)
        w.add_json("case/values.json", {"name": name}, "values")
        paths[name] = w.commit({"case": {"name": name}})
    assert sorted(p.name for p in evidence.iterdir()) == ["gradient_parity_32k", "gradient_parity_32k.json",
                                                          "online_grpo_2m", "online_grpo_2m.json"]
    receipt = load_receipt(paths["gradient_parity_32k.json"])
    assert [e["path"] for e in receipt["manifest"]] == ["gradient_parity_32k/case/values.json"]
    assert all(verify(p) == [] for p in paths.values())
    (evidence / "online_grpo_2m" / "stray.txt").write_text("x")
    assert verify(paths["online_grpo_2m.json"]) == ["unexpected file not in the manifest: online_grpo_2m/stray.txt"]
    assert verify(paths["gradient_parity_32k.json"]) == []
    with pytest.raises(FileExistsError):
        EvidenceWriter(evidence, provenance=PROVENANCE, receipt_name="gradient_parity_32k.json")
    for bad in ("receipt", "a/b.json", ".json", "../x.json"):
        with pytest.raises(EvidenceError, match="must be a plain file name ending in .json"):
            EvidenceWriter(evidence, provenance=PROVENANCE, receipt_name=bad)
