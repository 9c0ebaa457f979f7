"""Hash-bound evidence receipts for training transactions.

    writer = EvidenceWriter(run_dir)                  # refuses a dir that already has receipt.json
    writer.add_array("old_logprobs.npy", lp, kind="logprobs")
    writer.add_json("completions.json", rows, kind="completions")
    writer.commit({"prompt": {...}, "training": {...}})   # receipt.json, atomically, last
    assert verify(run_dir / "receipt.json") == []

CLI: `python -m glm52_jax.evidence verify RECEIPT [--json]` / `show RECEIPT`. No jax imports here.
"""

from glm52_jax.evidence.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from glm52_jax.evidence.provenance import (
                                           canonical_json,
                                           canonical_sha256,
                                           collect_provenance,
                                           config_hash,
                                           git_info,
                                           package_versions,
                                           source_digest,
)
from glm52_jax.evidence.receipt import (
                                           RECEIPT_NAME,
                                           SCHEMA,
                                           VERSION,
                                           EvidenceError,
                                           EvidenceWriter,
                                           deterministic_view,
                                           load_receipt,
                                           verify,
)

__all__ = ["RECEIPT_NAME", "SCHEMA", "VERSION", "EvidenceError", "EvidenceWriter", "atomic_write_bytes",
           "atomic_write_json", "atomic_write_text", "canonical_json", "canonical_sha256", "collect_provenance",
           "config_hash", "deterministic_view", "git_info", "load_receipt", "package_versions", "source_digest",
           "verify"]
