"""verify checks the receipt's internal cross-references: quoted hashes = the artifacts they name."""

import hashlib
import json

from glm52_jax.checkpoint.file_digest import file_digest
from glm52_jax.evidence import verify
from tests.receipt_forgery import resealed
from tests.run_helpers import ROOT

COMMITTED = ROOT / "evidence" / "online_grpo_tiny.json"


def test_a_replaced_lora_after_fails_verify_though_the_manifest_was_resealed(tmp_path):
    """lora_after.safetensors replaced (here by the adapters before the step), its manifest entry, manifest_sha256
    and receipt_sha256 recomputed as a forger would: training.lora_sha256_after no longer matches it."""
    assert verify(COMMITTED) == []

    def replace_lora_after(receipt, artifacts):
        (artifacts / "lora_after.safetensors").write_bytes((artifacts / "lora_before.safetensors").read_bytes())

    forged = resealed(COMMITTED, tmp_path, replace_lora_after)
    receipt = json.loads(forged.read_text())
    entry = next(e for e in receipt["manifest"] if e["path"].endswith("/lora_after.safetensors"))
    assert verify(forged) == [
        f"training.lora_sha256_after is {receipt['training']['lora_sha256_after']} but {entry['path']} hashes to "
        f"{entry['sha256']} (the artifact was replaced, or the receipt edited)"]


def _with_digests(receipt, artifacts):
    """The committed receipt predates the LoRA digests: quote them as a run now does (the files' values' digest)."""
    for when in ("before", "after"):
        receipt["training"][f"lora_digest_{when}"] = file_digest(artifacts / f"lora_{when}.safetensors")


def test_lora_digests_are_recomputed_from_the_files(tmp_path):
    """A receipt quoting its LoRA digests verifies (and one without them, the committed one, still does). A forger
    who replaces lora_after.safetensors, quotes its new sha256 and re-seals passes the sha256 cross-check, but the
    digest of the file's values is no longer the one the run computed on device."""
    assert verify(resealed(COMMITTED, tmp_path / "honest", _with_digests)) == []

    def replace_and_requote(receipt, artifacts):
        _with_digests(receipt, artifacts)
        forged = (artifacts / "lora_before.safetensors").read_bytes()
        (artifacts / "lora_after.safetensors").write_bytes(forged)
        receipt["training"]["lora_sha256_after"] = hashlib.sha256(forged).hexdigest()

    forged = resealed(COMMITTED, tmp_path / "forged", replace_and_requote)
    receipt = json.loads(forged.read_text())
    path = next(e["path"] for e in receipt["manifest"] if e["path"].endswith("/lora_after.safetensors"))
    assert verify(forged) == [
        f"training.lora_digest_after is {receipt['training']['lora_digest_after']} but the values in {path} digest "
        f"to {receipt['training']['lora_digest_before']} (the artifact was replaced, or the receipt edited)"]
