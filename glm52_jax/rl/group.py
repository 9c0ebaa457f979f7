"""Which of a request's samples form the GRPO group (`sampling.samples_per_request` > `num_samples`).

A request draws S = `sampling.samples_per_request` samples (the seed drew 8 per exact-2M request); all S
are rewarded and recorded, and the update trains on a group of G = `sampling.num_samples` of them, chosen
by this deterministic rule (pure Python, no randomness, so a rerun picks the same samples):

  1. all S rewards equal: no group (the candidate is not accepted; the search moves on to the next row);
  2. the first G samples' rewards differ: samples 0..G-1;
  3. else (the first G all share sample 0's reward): samples 0..G-2 and the first sample i whose reward
     differs from sample 0's, in the last slot. The group is thus mixed whenever the request's samples are.

With S = G this is the rule without the setting: the request's G samples, accepted when their rewards differ.
The chosen indices are in the receipt (`candidate_search.group_samples`, `training.group_samples`); the
update's tokens and old log-probs are those samples', in index order.
"""

from __future__ import annotations

from collections.abc import Sequence


def choose_group(rewards: Sequence[float], group_size: int) -> list[int] | None:
    """Indices (ascending) of the `group_size` samples the update trains on, or None when every reward is equal."""
    if group_size < 2 or group_size > len(rewards):
        raise ValueError(f"choose_group: group_size {group_size} must be >= 2 and <= the {len(rewards)} samples")
    if len(set(rewards)) == 1:
        return None
    if len(set(rewards[:group_size])) > 1:
        return list(range(group_size))
    other = next(i for i, r in enumerate(rewards) if r != rewards[0])  # exists: not all equal; i >= group_size
    return list(range(group_size - 1)) + [other]
