"""Candidate search pieces that need no model (`rl/search.py`); the search itself runs on the embedded policy in
tests/rl/test_transaction.py."""

import numpy as np

from glm52_jax.rl.search import group_result
from glm52_jax.rollout.sampler import SampleResult


def test_group_result_keeps_the_chosen_samples_rows():
    """The group's SampleResult holds rows `samples` of the request's, in that order; the rest is the request's."""
    s, n = 4, 3
    res = SampleResult(tokens=np.arange(s * n, dtype=np.int32).reshape(s, n),
                       logprobs=-np.arange(s * n, dtype=np.float32).reshape(s, n) / 10,
                       lengths=np.array([3, 1, 2, 3]), finish_reasons=["length", "stop", "stop", "length"],
                       prompt_len=7, prefix_hit_tokens=5, prefill_seconds=0.5, decode_seconds=0.25)
    group = group_result(res, [0, 3])
    np.testing.assert_array_equal(group.tokens, [[0, 1, 2], [9, 10, 11]])
    np.testing.assert_array_equal(group.logprobs, np.float32([[0.0, -0.1, -0.2], [-0.9, -1.0, -1.1]]))
    np.testing.assert_array_equal(group.lengths, [3, 3])
    assert group.finish_reasons == ["length", "length"] and group.completion(1) == [9, 10, 11]
    assert (group.prompt_len, group.prefix_hit_tokens, group.prefill_seconds) == (7, 5, 0.5)
    swapped = group_result(res, [2, 1])
    np.testing.assert_array_equal(swapped.tokens, [[6, 7, 8], [3, 4, 5]])
    assert swapped.finish_reasons == ["stop", "stop"] and swapped.completion(1) == [3]
    assert res.tokens.shape == (4, 3)  # the request's result is left as it was
