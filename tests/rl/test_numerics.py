"""Non-finite numbers stop a step before anything is committed (`rl/numerics.py`), as one launcher line."""

import numpy as np
import pytest

from glm52_jax.launch import _one_line
from glm52_jax.rl.numerics import NonFiniteError, all_finite, check_sampled


def test_a_nan_sampled_log_prob_stops_the_step_naming_where():
    logprobs = np.array([[-1.0, -2.0, 0.0], [-0.5, np.nan, np.nan]], np.float32)  # [G=2, R=3]
    check_sampled("step 1 candidate 0", logprobs, np.array([2, 1]))  # the NaNs lie past sample 1's end
    with pytest.raises(NonFiniteError, match=r"^step 1 candidate 0: non-finite sampling log-prob \(nan\) at sample 1 "
                                             r"token 1 \(2 such tokens\): .* stopped before anything was committed$"):
        check_sampled("step 1 candidate 0", logprobs, np.array([2, 3]))


def test_the_receipts_finite_covers_every_array():
    good = {"loss": 0.5, "old_logprobs": np.zeros((2, 3)), "rewards": [1.0, -1.0]}
    assert all_finite(good)
    assert not all_finite({**good, "old_logprobs": np.array([[0.0, np.nan]])})
    assert not all_finite({**good, "rewards": [1.0, float("inf")]})


def test_the_launcher_says_numerics_error():
    assert _one_line(NonFiniteError("step 1 candidate 0: x")) == "numerics error: step 1 candidate 0: x"
