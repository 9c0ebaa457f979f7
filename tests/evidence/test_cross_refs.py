"""verify checks the receipt's internal cross-references: quoted hashes = the artifacts they name."""

import hashlib
import json
import shutil

from glm52_jax.evidence import canonical_sha256, verify
from tests.run_helpers import ROOT

COMMITTED = ROOT / "evidence" / "online_grpo_tiny.json"


def test_a_replaced_lora_after_fails_verify_though_the_manifest_was_resealed(tmp_path):
    """lora_after.safetensors replaced (here by the adapters before the step), its manifest entry, manifest_sha256
    and receipt_sha256 recomputed as a forger would: training.lora_sha256_after no longer matches it."""
    assert verify(COMMITTED) == []
    artifacts = tmp_path / COMMITTED.stem
    shutil.copytree(COMMITTED.with_suffix(""), artifacts)
    receipt = json.loads(COMMITTED.read_text())
    data = (artifacts / "lora_before.safetensors").read_bytes()
    (artifacts / "lora_after.safetensors").write_bytes(data)
    entry = next(e for e in receipt["manifest"] if e["path"].endswith("/lora_after.safetensors"))
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    receipt.pop("receipt_sha256")
    receipt["manifest_sha256"] = canonical_sha256(receipt["manifest"])
    receipt["receipt_sha256"] = canonical_sha256(receipt)
    (tmp_path / COMMITTED.name).write_text(json.dumps(receipt, indent=2))
    assert verify(tmp_path / COMMITTED.name) == [
        f"training.lora_sha256_after is {receipt['training']['lora_sha256_after']} but {entry['path']} hashes to "
        f"{entry['sha256']} (the artifact was replaced, or the receipt edited)"]
