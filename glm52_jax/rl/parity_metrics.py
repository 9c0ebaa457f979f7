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


def _accumulate(sums: dict[str, np.ndarray], family: str, a: np.ndarray, r: np.ndarray) -> None:
    """Adds one parameter's [a.r, a.a, r.r, |a - r|^2] (float64) to its family's running sums."""
    d = a - r
    sums.setdefault(family, np.zeros(4))[:] += (a @ r, a @ a, r @ r, d @ d)


def _cosine_rel_l2(sums: np.ndarray) -> dict[str, float | None]:
    """Cosine and |a - ref| / |ref| from [a.r, a.a, r.r, |a - r|^2]; None where undefined (a zero norm)."""
    ar, aa, rr, dd = (float(v) for v in sums)
    na, nr = np.sqrt(aa), np.sqrt(rr)
    return {"cosine": float(ar / (na * nr)) if na > 0 and nr > 0 else None,
            "rel_l2": float(np.sqrt(dd) / nr) if nr > 0 else None}


def cosine_rel_l2(a: np.ndarray, ref: np.ndarray) -> dict[str, float | None]:
    """Cosine of `a` and `ref`, and |a - ref| / |ref|; None where undefined (a zero norm)."""
    a, ref = np.asarray(a, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    d = a - ref
    return _cosine_rel_l2(np.array([a @ ref, a @ a, ref @ ref, d @ d]))


def _outlier_row(name: str, a: np.ndarray, r: np.ndarray) -> dict[str, Any]:
    diff = np.abs(a - r)
    norm = float(np.sqrt(r @ r))
    return {"name": name, "rel_l2": float(np.sqrt(diff @ diff) / norm) if norm > 0 else None,
            "max_abs_diff": float(diff.max(initial=0.0)), "ref_l2": norm,
            "ref_max_abs": float(np.abs(r).max(initial=0.0))}


def _largest(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    # Largest first; a parameter whose reference is zero (undefined relative value) ranks by its absolute diff.
    rows = sorted(rows, key=lambda row: (row["rel_l2"] is not None, row["rel_l2"] or row["max_abs_diff"]), reverse=True)
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
                 params_digest: str | None = None, ref_params_digest: str | None = None) -> dict[str, Any]:
    """Every metric of the seed's parity table for `grads` (a mode) against `ref` (the reference mode).

    logprobs, ref_logprobs, mask: [G,R] (mask 1 on valid response tokens). The shard and starting-parameter
    comparisons are made when both sides are given (a PyTorch reference has whole arrays and its own copy).
    One parameter at a time: `grads` and `ref` may be mappings that read each array when indexed
    (`parity_shards.ShardedArrays`), so host memory is a few copies of the largest parameter (float64), not the
    gradients; the families' cosines and relative L2 come from running float64 sums of a.r, a.a, r.r, |a - r|^2."""
    names, ref_names = sorted(grads), sorted(ref)
    if names != ref_names:
        differ = sorted(set(names) ^ set(ref_names))[:5]
        raise ValueError(f"parity: the modes' gradients name different parameters: {differ}")
    sums: dict[str, np.ndarray] = {}
    rows: list[dict[str, Any]] = []
    mask_diff = elements = nonfinite = reference_nonfinite = 0
    for name in names:
        g, r = np.asarray(grads[name]), np.asarray(ref[name])
        mask_diff += int(np.count_nonzero((g == 0) != (r == 0)))
        nonfinite += int(np.count_nonzero(~np.isfinite(g)))
        reference_nonfinite += int(np.count_nonzero(~np.isfinite(r)))
        elements += int(g.size)
        a64, r64 = g.astype(np.float64).ravel(), r.astype(np.float64).ravel()
        del g, r
        _accumulate(sums, families[name], a64, r64)
        rows.append(_outlier_row(name, a64, r64))
        del a64, r64
    if sums:
        sums = dict(sorted(sums.items()))
        sums[FAMILY_ALL] = np.sum(list(sums.values()), axis=0)
    valid = np.asarray(mask) != 0
    logp_diff = np.abs(np.asarray(logprobs, np.float64) - np.asarray(ref_logprobs, np.float64))
    out = {
        "logprob_abs": float(logp_diff[valid].max(initial=0.0)),
        "loss_abs": abs(float(loss) - float(ref_loss)),
        "families": {f: _cosine_rel_l2(v) for f, v in sums.items()},
        "mask_differences": mask_diff,
        "elements": elements,
        "nonfinite": nonfinite,
        "reference_nonfinite": reference_nonfinite,
        "outliers": _largest(rows, outliers),
    }
    if shards is not None and ref_shards is not None:
        out["shards"] = compare_shards(shards, ref_shards)
    if params_digest is not None and ref_params_digest is not None:
        out["params_equal"] = params_digest == ref_params_digest
    return out
