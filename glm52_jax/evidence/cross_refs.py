"""A receipt's internal cross-references: a hash the receipt quotes must be the hash of the artifact it names.

The manifest binds each artifact's bytes, but `training.lora_sha256_after` is a second statement about
lora_after.safetensors: a forger who replaces the file and re-seals the manifest leaves that quote stale.
`verify` reports every such mismatch. Imports no JAX.

The LoRA digests (`training.lora_digest_*`, computed per shard on device: `host_digest`) are recomputed from
the files' values (numpy, imported only then): the adapters the run held are the adapters it shipped.
Receipts from before the digests quote none, and verify as they did.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

# (dotted key in the receipt, artifact file name it quotes the sha256 of)
QUOTED_HASHES = (("training.lora_sha256_before", "lora_before.safetensors"),
                 ("training.lora_sha256_after", "lora_after.safetensors"))
# (dotted key, artifact file name) whose quoted value is `checkpoint.file_digest` of that safetensors file
QUOTED_DIGESTS = (("training.lora_digest_before", "lora_before.safetensors"),
                  ("training.lora_digest_after", "lora_after.safetensors"))


def _get(receipt: Mapping[str, Any], dotted: str) -> Any:
    value: Any = receipt
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _quotes(receipt: Mapping[str, Any], pairs, what: str, failures: list[str]):
    """(key, quoted value, manifest entry) for each of `pairs` (dotted key, artifact name) the receipt quotes; a
    quote whose artifact the manifest does not list is a failure line (`what`: "sha256" or "digest")."""
    manifest = receipt.get("manifest")
    if not isinstance(manifest, list):
        return
    by_name = {str(e.get("path", "")).rpartition("/")[2]: e for e in manifest if isinstance(e, Mapping)}
    for key, name in pairs:
        quoted = _get(receipt, key)
        if quoted is None:
            continue
        entry = by_name.get(name)
        if entry is None:
            failures.append(f"{key} quotes the {what} of {name}, which the manifest does not list")
        else:
            yield key, quoted, entry


def quoted_hash_failures(receipt: Mapping[str, Any]) -> list[str]:
    """One line per quoted hash that differs from its artifact's manifest sha256 (the manifest's own check
    ties that sha256 to the file's bytes); a quote whose artifact is not in the manifest is a failure too."""
    failures: list[str] = []
    for key, quoted, entry in _quotes(receipt, QUOTED_HASHES, "sha256", failures):
        if entry.get("sha256") != quoted:
            failures.append(f"{key} is {quoted} but {entry.get('path')} hashes to {entry.get('sha256')} (the artifact "
                            "was replaced, or the receipt edited)")
    return failures


def quoted_digest_failures(run_dir: Path, receipt: Mapping[str, Any], readable: Collection[str]) -> list[str]:
    """One line per quoted state digest that differs from the digest of its file's values (`readable`: the
    manifest paths whose bytes verified; a quote of a file not among them is reported by the manifest checks)."""
    failures: list[str] = []
    for key, quoted, entry in _quotes(receipt, QUOTED_DIGESTS, "digest", failures):
        path = str(entry.get("path"))
        if path not in readable:
            continue
        from glm52_jax.checkpoint.file_digest import file_digest

        try:
            actual = file_digest(run_dir / path)
        except (ValueError, TypeError, KeyError) as e:
            failures.append(f"{key}: {path} cannot be read as safetensors ({e})")
            continue
        if actual != quoted:
            failures.append(f"{key} is {quoted} but the values in {path} digest to {actual} (the artifact was "
                            "replaced, or the receipt edited)")
    return failures
