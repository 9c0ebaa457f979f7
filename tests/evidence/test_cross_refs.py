"""verify checks the receipt's internal cross-references: quoted hashes = the artifacts they name."""

import json

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
