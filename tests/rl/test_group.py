"""The group-selection rule (`rl/group.py`): which of a request's samples the update trains on."""

import pytest

from glm52_jax.rl.group import choose_group


@pytest.mark.parametrize("rewards,g,group", [
    # S = G (samples_per_request = 0): today's rule, the request's samples when mixed.
    ([-1.0, 1.0], 2, [0, 1]),
    ([1.0, -1.0], 2, [0, 1]),
    ([1.0, 1.0], 2, None),
    ([-1.0, -1.0, -1.0, 1.0], 4, [0, 1, 2, 3]),
    # S > G, the first G already mixed: the first G in index order (later samples ignored).
    ([-1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0], 2, [0, 1]),
    ([1.0, 1.0, -1.0, 1.0], 3, [0, 1, 2]),
    # S > G, the first G all equal: the first sample that differs from sample 0 takes the last slot.
    ([-1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0], 2, [0, 5]),
    ([1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 1.0], 3, [0, 1, 3]),
    ([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, -1.0], 2, [0, 7]),  # the very last sample
    # all S equal: not accepted (the search moves on).
    ([-1.0] * 8, 2, None),
    ([1.0] * 8, 8, None),
])
def test_choose_group(rewards, g, group):
    assert choose_group(rewards, g) == group
    if group is not None:  # the chosen group is always mixed, sorted, and of size G
        assert len(group) == g and group == sorted(set(group)) and len({rewards[i] for i in group}) > 1


@pytest.mark.parametrize("rewards,g", [([1.0, -1.0], 3), ([1.0, -1.0, 1.0], 1)])
def test_group_size_must_fit_the_samples(rewards, g):
    with pytest.raises(ValueError, match=f"group_size {g} must be >= 2 and <= the {len(rewards)} samples"):
        choose_group(rewards, g)
