"""Decode audit rules on hand-made samples: each rule fires where it should and nowhere else."""

import pytest

from glm52_jax.dapo_data import DAPO_PROMPT_PREFIX, DAPO_PROMPT_SUFFIX
from glm52_jax.rl import decode_audit


def _record(text="Answer: 4", tokens=(5, 6, 7), finish_reason="stop", candidate=0, sample=0):
    return {"request": "candidate", "candidate": candidate, "sample": sample, "text": text, "tokens": list(tokens),
            "finish_reason": finish_reason}


@pytest.mark.parametrize("tokens, expect", [
    ([1, 2, 9, 9, 9, 9], (1, 4)),  # one token four times at the end
    ([9, 9, 9, 9, 9, 9], (1, 6)),  # the whole sample: all repeats counted
    ([1, 2, 9, 9, 9], None),  # three times: below MIN_REPEATS
    ([3, 4, 3, 4, 3, 4, 3, 4], (2, 4)),  # a two-token cycle
    ([5, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4], (2, 5)),
    ([3, 4, 3, 4, 3, 4, 3], None),  # 3.5 cycles of 2 tokens
    ([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], (3, 4)),
    ([1, 2, 3, 4, 5] * 4, None),  # period 5 > MAX_PERIOD
    ([9, 9, 9, 9, 1], None),  # a repeat that is not at the end
    ([], None),
])
def test_repeating_tail(tokens, expect):
    assert decode_audit.repeating_tail(tokens) == expect


def test_stop_token_is_not_part_of_the_repeat():
    # Three 9s and the stop token 0: not a degeneration; the same ids capped by length are not either
    # (0 differs from 9), while four 9s before the stop token are.
    assert decode_audit.repeating_tail(decode_audit.generated_tokens([9, 9, 9, 0], "stop")) is None
    assert decode_audit.repeating_tail(decode_audit.generated_tokens([9, 9, 9, 9, 0], "stop")) == (1, 4)
    assert decode_audit.repeating_tail(decode_audit.generated_tokens([0, 0, 0, 0], "length")) == (1, 4)
    assert decode_audit.repeating_tail(decode_audit.generated_tokens([0, 0, 0, 0], "stop")) is None


@pytest.mark.parametrize("text, expect", [
    ("Answer: 4", None),  # the requested format itself
    ("so the answer is 4.\nAnswer: 4", None),
    ("Answer: $Answer", "$Answer"),  # the template placeholder
    ("the last line of your response should be", "last line of your response"),  # the first run, sorted
    ("Remember to put your answer on its own line", "answer on its own line"),
    ("REMEMBER TO PUT YOUR ANSWER", "remember to put your answer"),  # compared lowercased
    ("put your answer on", None),  # four words only
])
def test_marker_echo(text, expect):
    assert decode_audit.marker_echo(text) == expect


def test_instruction_runs_come_from_the_dapo_prompt():
    words = (DAPO_PROMPT_PREFIX + " " + DAPO_PROMPT_SUFFIX).lower().split()
    assert ("remember", "to", "put", "your", "answer") in decode_audit.INSTRUCTION_RUNS
    assert all(" ".join(run) in " ".join(words) for run in decode_audit.INSTRUCTION_RUNS)
    assert len(decode_audit.INSTRUCTION_RUNS) > 20


def test_audit_counts_and_names_each_flagged_sample():
    records = [
        _record("Answer: 4", [5, 6, 0], "stop", 0, 0),
        _record("Answer: 2\ufffd\ufffd", [5, 6, 7, 8], "length", 0, 1),
        _record("1111", [8, 8, 8, 8], "length", 1, 0),
        _record("where $Answer is", [3, 1, 0], "stop", 1, 1),
    ]
    summary = decode_audit.audit(records)
    assert summary["samples"] == 4 and summary["stopped"] == 2 and summary["length_capped"] == 2
    assert summary["replacement_chars"] == 2
    assert summary["replacement_char_samples"] == [{"request": "candidate", "candidate": 0, "sample": 1, "count": 2}]
    assert summary["degenerate_samples"] == [{"request": "candidate", "candidate": 1, "sample": 0, "period": 1,
                                              "repeats": 4}]
    assert summary["marker_echo_samples"] == [{"request": "candidate", "candidate": 1, "sample": 1,
                                               "echo": "$Answer"}]
    assert summary["rules"] == {"degenerate_max_period": 4, "degenerate_min_repeats": 4, "echo_words": 5,
                                "echo_placeholder": "$Answer"}
    clean = decode_audit.audit([records[0]])
    assert (clean["replacement_chars"], clean["degenerate_samples"], clean["marker_echo_samples"]) == (0, [], [])
