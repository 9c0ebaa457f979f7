"""The seed's gradient-parity metrics for one mode pair, and the acceptance decision (numpy only).

A pair is a mode's gradients against the reference mode's (conventional), both on the same rollout
fixture and LoRA state, held on the host as `{parameter name: array}` in our layout. Per pair:

  logprob_abs        max |new log-prob difference| over the valid response tokens
  loss_abs           |loss difference|
  families           per LoRA family and "all" (the global value): cosine and relative L2 (|a - r| / |r|)
  mask_differences   elements that are exactly zero in one gradient and not in the other
  nonfinite          non-finite gradient elements of the mode (the reference's are reported with it)
  shards             the exported shard sets (name, index, shape, dtype): counts, missing and extra
  params_equal       both paths started from byte-identical LoRA parameters (their hashes)
  outliers           the parameters with the largest relative L2 difference, with their absolute scale

Cosine and relative L2 are None where a norm is zero (undefined; receipts hold no NaN); a bound on an
undefined value fails. Computed in float64. The decision against bounds is `glm52_jax.parity_decision.decide`
(re-exported here), which `python -m glm52_jax.evidence verify` re-runs on a receipt's stored metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from glm52_jax.parity_decision import decide, measured  # noqa: F401  (the decision, shared with evidence/)

FAMILY_ALL = "all"


def family_vectors(grads: Mapping[str, np.ndarray], families: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Gradients flattened (float64) per LoRA family (`families[name]`), plus "all" over every family."""
    parts: dict[str, list[np.ndarray]] = {}
    for name in sorted(grads):
        parts.setdefault(families[name], []).append(np.asarray(grads[name], np.float64).ravel())
    vecs = {f: np.concatenate(v) for f, v in sorted(parts.items())}
    vecs[FAMILY_ALL] = np.concatenate([vecs[f] for f in sorted(parts)])
    return vecs


def cosine_rel_l2(a: np.ndarray, ref: np.ndarray) -> dict[str, float | None]:
    """Cosine of `a` and `ref`, and |a - ref| / |ref|; None where undefined (a zero norm)."""
    na, nr = float(np.linalg.norm(a)), float(np.linalg.norm(ref))
    return {"cosine": float(a @ ref / (na * nr)) if na > 0 and nr > 0 else None,
            "rel_l2": float(np.linalg.norm(a - ref) / nr) if nr > 0 else None}


def compare_families(a: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray]) -> dict[str, dict]:
    """Per family of `ref` (and "all"): cosine and relative L2 of `a` against `ref`."""
    return {f: cosine_rel_l2(a[f], r) for f, r in ref.items()}


def _outliers(grads: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], n: int) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(ref):
        a, r = np.asarray(grads[name], np.float64), np.asarray(ref[name], np.float64)
        diff = np.abs(a - r)
        norm = float(np.linalg.norm(r))
        rows.append({"name": name, "rel_l2": float(np.linalg.norm(diff) / norm) if norm > 0 else None,
                     "max_abs_diff": float(diff.max(initial=0.0)), "ref_l2": norm,
                     "ref_max_abs": float(np.abs(r).max(initial=0.0))})
    # Largest first; a parameter whose reference is zero (undefined relative value) ranks by its absolute diff.
    rows.sort(key=lambda row: (row["rel_l2"] is not None, row["rel_l2"] or row["max_abs_diff"]), reverse=True)
    return [row for row in rows if row["max_abs_diff"] > 0][:n]


def _shard_key(record: Mapping[str, Any]) -> tuple:
    return (record["name"], tuple(map(tuple, record["index"])), tuple(record["shape"]), record["dtype"])


def compare_shards(records: Sequence[Mapping], ref_records: Sequence[Mapping], limit: int = 10) -> dict[str, Any]:
    """Shard sets (one record per device shard; see parity_shards) compared by (name, index, shape, dtype)."""
    keys, ref_keys = {_shard_key(r) for r in records}, {_shard_key(r) for r in ref_records}
    missing, extra = sorted(ref_keys - keys), sorted(keys - ref_keys)
    show = lambda ks: [f"{k[0]}{list(map(list, k[1]))}" for k in ks[:limit]]  # noqa: E731
    return {"count": len(records), "reference_count": len(ref_records), "missing_count": len(missing),
            "extra_count": len(extra), "missing": show(missing), "extra": show(extra),
            "set_equal": not missing and not extra and len(records) == len(ref_records)}


def pair_metrics(grads: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], families: Mapping[str, str], *,
                 logprobs: np.ndarray, ref_logprobs: np.ndarray, mask: np.ndarray, loss: float, ref_loss: float,
                 outliers: int, shards: Sequence[Mapping] | None = None, ref_shards: Sequence[Mapping] | None = None,
                 params_sha256: str | None = None, ref_params_sha256: str | None = None) -> dict[str, Any]:
    """Every metric of the seed's parity table for `grads` (a mode) against `ref` (the reference mode).

    logprobs, ref_logprobs, mask: [G,R] (mask 1 on valid response tokens). The shard and starting-parameter
    comparisons are made when both sides are given (a PyTorch reference has whole arrays and its own copy)."""
    names, ref_names = sorted(grads), sorted(ref)
    if names != ref_names:
        differ = sorted(set(names) ^ set(ref_names))[:5]
        raise ValueError(f"parity: the modes' gradients name different parameters: {differ}")
    valid = np.asarray(mask) != 0
    logp_diff = np.abs(np.asarray(logprobs, np.float64) - np.asarray(ref_logprobs, np.float64))
    mask_diff = sum(int(np.count_nonzero((np.asarray(grads[n]) == 0) != (np.asarray(ref[n]) == 0))) for n in names)
    nonfinite = lambda g: sum(int(np.count_nonzero(~np.isfinite(g[n]))) for n in names)  # noqa: E731
    out = {
        "logprob_abs": float(logp_diff[valid].max(initial=0.0)),
        "loss_abs": abs(float(loss) - float(ref_loss)),
        "families": compare_families(family_vectors(grads, families), family_vectors(ref, families)),
        "mask_differences": mask_diff,
        "elements": sum(int(np.asarray(grads[n]).size) for n in names),
        "nonfinite": nonfinite(grads),
        "reference_nonfinite": nonfinite(ref),
        "outliers": _outliers(grads, ref, outliers),
    }
    if shards is not None and ref_shards is not None:
        out["shards"] = compare_shards(shards, ref_shards)
    if params_sha256 is not None and ref_params_sha256 is not None:
        out["params_equal"] = params_sha256 == ref_params_sha256
    return out
