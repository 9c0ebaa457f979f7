"""Publishing a verified receipt under its own name, and comparing two receipts' results (real files)."""

from __future__ import annotations

import json

import pytest

from glm52_jax.evidence import EvidenceError, load_receipt, verify
from glm52_jax.evidence.__main__ import main
from glm52_jax.evidence.publish import publish, result_differences
from tests.evidence.test_receipt import FIELDS, _rehash, _save, _write_run


def test_published_receipt_verifies_and_keeps_what_it_computed(tmp_path):
    source = _write_run(tmp_path / "run")
    dest = publish(source.parent, tmp_path / "evidence" / "online_grpo_tiny.json")
    assert verify(dest) == []
    original, published = load_receipt(source), load_receipt(dest)
    # Same sections and artifacts (bytes, hashes), the directory renamed; bound to the original's hashes.
    assert {e["path"] for e in published["manifest"]} == {"online_grpo_tiny/" + e["path"].split("/", 1)[1]
                                                          for e in original["manifest"]}
    assert [(e["sha256"], e["bytes"]) for e in published["manifest"]] == [(e["sha256"], e["bytes"])
                                                                          for e in original["manifest"]]
    assert published["published"] == {"from": "receipt.json", "receipt_sha256": original["receipt_sha256"],
                                       "manifest_sha256": original["manifest_sha256"]}
    assert published["nondeterministic"] == ["traces", "online_grpo_tiny/timing.json"]
    assert result_differences(source, dest) == []
    # A published receipt publishes again (named -> named), and tampering with it is caught.
    again = publish(dest, tmp_path / "elsewhere" / "copy.json")
    assert verify(again) == [] and result_differences(dest, again) == []
    tampered = load_receipt(dest)
    tampered["rewards"]["scores"][0] = 0.0
    _save(dest, tampered)
    assert any("receipt.json was modified" in f for f in verify(dest))


def test_publish_refuses_an_invalid_source_and_an_existing_destination(tmp_path):
    source = _write_run(tmp_path / "run")
    dest = publish(source, tmp_path / "out" / "r.json")
    with pytest.raises(EvidenceError, match="exists; remove it first"):
        publish(source, dest)
    bad = load_receipt(source)
    bad["rewards"]["scores"][1] = 9.0
    _save(source, bad)  # hashes not recomputed: the source no longer verifies
    with pytest.raises(EvidenceError, match="does not verify"):
        publish(source, tmp_path / "out" / "s.json")
    assert not (tmp_path / "out" / "s").exists() and not (tmp_path / "out" / "s.json").exists()


def test_compare_names_what_differs(tmp_path):
    first = _write_run(tmp_path / "a")
    second_fields = json.loads(json.dumps(FIELDS))
    second_fields["rewards"]["scores"][2] = 1.0 + 1e-7  # within the tolerance
    # A hash of float data (the trained LoRA's bytes) changes with the last bit of one float: another CPU's code.
    second_fields["numerics"]["lora_sha256_after"] = "f" * 64
    second = _write_run(tmp_path / "b", fields=second_fields, wall_s=9.0)  # traces are nondeterministic
    assert result_differences(first, second) == []
    third_fields = json.loads(json.dumps(FIELDS))
    third_fields["rewards"]["scores"][3] = 0.75
    third_fields["prompt"]["text"] = "What is 7*6?"
    third = _write_run(tmp_path / "c", fields=third_fields)
    assert result_differences(first, third) == ["receipt.prompt.text: 'What is 6*7?' vs 'What is 7*6?'",
                                                "receipt.rewards.scores[3]: 0.5 vs 0.75"]
    assert result_differences(first, third, ignore=("prompt.text",)) == ["receipt.rewards.scores[3]: 0.5 vs 0.75"]
    fourth_fields = json.loads(json.dumps(FIELDS))
    fourth_fields["numerics"]["loss"] = 0.25 + 4e-6  # rounding-level on another machine
    fourth_fields["rewards"]["scores"][3] = 0.6
    fourth = _write_run(tmp_path / "d", fields=fourth_fields)
    assert result_differences(first, fourth, noise=1e-5) == ["receipt.rewards.scores[3]: 0.5 vs 0.6"]
    assert result_differences(first, fourth, noise=1e-5, ignore=("rewards.*",)) == []
    assert len(result_differences(first, fourth)) == 2
    assert main(["compare", str(first), str(second)]) == 0
    assert main(["compare", str(first), str(third)]) == 1
    assert main(["publish", str(first), str(tmp_path / "pub" / "x.json")]) == 0
    assert verify(tmp_path / "pub" / "x.json") == []


def test_rehashed_forgery_of_a_published_receipt_still_differs_in_results(tmp_path):
    """A forger who recomputes the hashes passes `verify`, but the comparison against a regenerated run names it."""
    dest = publish(_write_run(tmp_path / "run"), tmp_path / "e" / "r.json")
    forged = load_receipt(dest)
    forged["rewards"]["scores"][0] = 0.0
    _save(dest, _rehash(forged))
    assert verify(dest) == []
    regenerated = _write_run(tmp_path / "again")
    assert result_differences(regenerated, dest) == ["receipt.rewards.scores[0]: 1.0 vs 0.0"]


