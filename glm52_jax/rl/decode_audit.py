"""Decode audit: rule-based checks for broken decoding over raw sampler records (pure Python, no JAX).

The seed's exact-2M report audited its 16 outputs for Unicode replacement characters, obvious
degenerations, echoes of the prompt's answer-marker instruction and stop vs length-capped endings
("zero replacement characters, one numeric/escape degeneration, one bounded target-marker echo").
This module states each rule exactly, so the counts in a receipt's "decode_audit" section can be
recomputed from `samples.jsonl`:

* replacement characters: occurrences of U+FFFD in the decoded text (a token sequence that is not
  valid UTF-8, e.g. a multi-byte character cut by the length cap or garbage bytes).
* degeneration: the generated tokens (the stop token excluded) END in a unit of `p` tokens,
  1 <= p <= `MAX_PERIOD`, repeated back to back at least `MIN_REPEATS` times: for p = 1 the last 4
  tokens are one token; for p = 2 the last 8 tokens are "a b a b a b a b"; and so on. The smallest
  such p is reported with the number of back-to-back repeats of its unit at the end.
* marker echo: the text contains the DAPO template placeholder ``$Answer``, or a run of
  `ECHO_WORDS` consecutive words of the DAPO instruction (`dapo_data.DAPO_PROMPT_PREFIX` and
  `DAPO_PROMPT_SUFFIX`; words = whitespace-separated, compared lowercased). A plain final line
  ``Answer: 4`` is the requested format, not an echo.
* finish reasons: "stop" (a stop token ended the sample) vs "length" (`max_new_tokens` reached).

Record fields read: "tokens", "text", "finish_reason", and "request" / "candidate" / "sample" to
name flagged samples (the `rl.samples` record layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from glm52_jax.dapo_data import DAPO_PROMPT_PREFIX, DAPO_PROMPT_SUFFIX

REPLACEMENT_CHAR = "\ufffd"
MAX_PERIOD = 4  # longest repeating unit (tokens) counted as a degeneration
MIN_REPEATS = 4  # back-to-back repeats of the unit at the end of the sample
ECHO_WORDS = 5  # consecutive instruction words that make an echo
PLACEHOLDER = "$Answer"  # the template's placeholder; never part of a real answer


def _word_runs(text: str, n: int) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


INSTRUCTION_RUNS = frozenset(_word_runs(DAPO_PROMPT_PREFIX, ECHO_WORDS) | _word_runs(DAPO_PROMPT_SUFFIX, ECHO_WORDS))


def generated_tokens(tokens: Sequence[int], finish_reason: str) -> list[int]:
    """The sample's tokens without its stop token (the sampler counts it in the length)."""
    tokens = list(tokens)
    return tokens[:-1] if finish_reason == "stop" and tokens else tokens


def repeating_tail(tokens: Sequence[int], *, max_period: int = MAX_PERIOD,
                   min_repeats: int = MIN_REPEATS) -> tuple[int, int] | None:
    """(period p, back-to-back repeats of the last p tokens at the end) for the smallest p whose unit
    repeats at least `min_repeats` times at the end of `tokens`; None when no p <= max_period does."""
    n = len(tokens)
    for p in range(1, max_period + 1):
        if n < p * min_repeats:
            break
        unit = list(tokens[n - p:])
        repeats = 1
        while (repeats + 1) * p <= n and list(tokens[n - (repeats + 1) * p:n - repeats * p]) == unit:
            repeats += 1
        if repeats >= min_repeats:
            return p, repeats
    return None


def marker_echo(text: str) -> str | None:
    """The echoed instruction text (the placeholder or the first instruction word run found), or None."""
    if PLACEHOLDER in text:
        return PLACEHOLDER
    found = sorted(_word_runs(text, ECHO_WORDS) & INSTRUCTION_RUNS)
    return " ".join(found[0]) if found else None


def _sample_id(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: record.get(k) for k in ("request", "candidate", "sample")}


def audit(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The audit summary of sampler records (the receipt's "decode_audit" section): the rules' parameters,
    counts, and each flagged sample named by request / candidate / sample index."""
    summary: dict[str, Any] = {
        "rules": {"degenerate_max_period": MAX_PERIOD, "degenerate_min_repeats": MIN_REPEATS,
                  "echo_words": ECHO_WORDS, "echo_placeholder": PLACEHOLDER},
        "samples": 0, "stopped": 0, "length_capped": 0, "replacement_chars": 0,
        "replacement_char_samples": [], "degenerate_samples": [], "marker_echo_samples": [],
    }
    for record in records:
        text, reason = record["text"], record["finish_reason"]
        summary["samples"] += 1
        summary["stopped"] += reason == "stop"
        summary["length_capped"] += reason == "length"
        bad_chars = text.count(REPLACEMENT_CHAR)
        if bad_chars:
            summary["replacement_chars"] += bad_chars
            summary["replacement_char_samples"].append({**_sample_id(record), "count": bad_chars})
        tail = repeating_tail(generated_tokens(record["tokens"], reason))
        if tail is not None:
            summary["degenerate_samples"].append({**_sample_id(record), "period": tail[0], "repeats": tail[1]})
        echo = marker_echo(text)
        if echo is not None:
            summary["marker_echo_samples"].append({**_sample_id(record), "echo": echo})
    return summary
