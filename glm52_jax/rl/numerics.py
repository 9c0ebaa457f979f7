"""Non-finite values stop a step before anything is committed, with one line naming where they appeared.

A base checkpoint with a NaN weight makes the sampler's log-probs NaN; without these checks the search
scored those samples, the update saw a NaN loss, and the step was committed with its checkpoint. Imports
no JAX.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class NonFiniteError(ValueError):
    """Non-finite numbers in a step: the step stops, uncommitted (the launcher's "numerics error")."""


def check_sampled(where: str, logprobs: np.ndarray, lengths: np.ndarray) -> None:
    """Raises `NonFiniteError` when a sampled token's log-prob (`logprobs` [G, R], valid below `lengths` [G])
    is not finite, naming the first sample and token."""
    logprobs = np.asarray(logprobs)
    valid = np.arange(logprobs.shape[1])[None, :] < np.asarray(lengths)[:, None]  # [G, R]
    bad = np.argwhere(valid & ~np.isfinite(logprobs))
    if bad.size:
        g, t = (int(i) for i in bad[0])
        raise NonFiniteError(f"{where}: non-finite sampling log-prob ({logprobs[g, t]}) at sample {g} token {t} "
                             f"({len(bad)} such tokens): the base or adapter weights hold non-finite values; the "
                             "step was stopped before anything was committed")


def all_finite(arrays: Mapping[str, object]) -> bool:
    """Whether every number of every named array (or scalar) is finite: the receipt's `numerics.finite`
    vouches for each array it keeps, not only the loss."""
    return all(bool(np.isfinite(np.asarray(v, np.float64)).all()) for v in arrays.values())
