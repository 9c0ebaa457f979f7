"""DAPO math rule reward: +1 when the final answer matches the ground truth, -1 otherwise.

Reference semantics: verl `verl/utils/reward_score/math_dapo.py::compute_score` as on verl's main
branch from the DAPO recipe (2025-04) until 2026-08 (the Minerva / lm-eval-harness `hendrycks_math`
normaliser). Everything below reproduces that behaviour, quirks included:

* Only the last 300 characters of the solution are looked at.
* Default ("Minerva") mode: the text after the last ``Answer:`` (case-insensitive, to the end of
  that line) is normalised by `normalize_final_answer`, as is the ground truth, and the two strings
  must be equal. No ``Answer:`` gives the prediction ``"[INVALID]"``. Trailing punctuation is kept,
  so ``"Answer: 42."`` does not match ``"42"``.
* Strict box mode: the last ``\\boxed{...}`` in the last 100 characters (or from
  ``pause_tokens_index[-1] - 100`` on) must equal the ground truth verbatim, with no normalisation;
  without a box the prediction is ``None``.
* ``boxed_fallback=True`` (off by default; run key ``reward.boxed_fallback``): the rule of verl
  0.9.1's math_dapo.py (its ``verify``; verl 0.5.0 to 0.9.0 have none). When the default mode's
  prediction is ``"[INVALID]"`` (after normalisation, so ``Answer: [INVALID]`` too), the strict-box
  check of the same 300-character tail decides instead (verbatim comparison, 100-character window,
  `pause_tokens_index`); without a box there, the default mode's result stands. The seed's runs
  scored without it.

Intentional differences: malformed input raises ``TypeError`` / ``ValueError`` with a message where
the reference raises ``AttributeError`` / ``AssertionError``, and `is_correct_strict_box` returns a
bool where the reference returns +1 / -1.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

SOLUTION_TAIL_CHARS = 300  # verl: the longest MATH-500 answer has 159 characters
BOX_TAIL_CHARS = 100
INVALID = "[INVALID]"
ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
BOX_PREFIX = "\\boxed{"
# What a receipt records of the rule that scored its samples (section "reward_rule"); `verify
# --recompute-rewards` scores with the same setting.
RULE_NAME = "dapo"
RULE_REFERENCE = "verl verl/utils/reward_score/math_dapo.py compute_score, default (Minerva) mode"

# Literal replacements, applied in this order after dropping everything up to the last "=".
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Literals deleted next, in this order. Two entries hold a real newline (a non-raw "\n" upstream).
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)

# Regex rewrites, each applied to every match, in this order.
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # keep only the first $...$ of a line
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # greedy: up to the last "}"
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def _require_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def normalize_final_answer(final_answer: str) -> str:
    """Canonical form of an answer string (Minerva / hendrycks_math normaliser).

    Steps: keep the text after the last ``=``; literal `SUBSTITUTIONS`; delete
    `REMOVED_EXPRESSIONS`; regex rewrites (first ``$...$`` only, unwrap ``\\text``, ``\\textbf``,
    ``\\overline``, ``\\boxed``, expand ``\\frac12`` and ``\\sqrt2``); drop ``$``; drop commas from
    an all-digit answer; strip surrounding whitespace.
    """
    text = _require_str("final_answer", final_answer).rpartition("=")[2]
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    for pattern, repl in _REWRITES:
        text = pattern.sub(repl, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` in `text`, braces balanced, or None if absent or unclosed."""
    start = _require_str("text", text).rfind(BOX_PREFIX)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(BOX_PREFIX) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The contents of ``\\boxed{...}``; ValueError if `boxed` is not of that form."""
    if not (_require_str("boxed", boxed).startswith(BOX_PREFIX) and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} expression: {boxed!r}")
    return boxed[len(BOX_PREFIX) : -1]


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False) -> tuple[bool, str]:
    """Compare the last ``Answer:`` line of `solution_str` with `gt`, both normalised.

    Returns ``(correct, normalised prediction)``; the prediction is ``"[INVALID]"`` when no
    ``Answer:`` is followed by at least one character. With `gt_need_extract` the ground truth is
    taken from its last ``\\boxed{}`` first.
    """
    matches = ANSWER_RE.findall(_require_str("solution_str", solution_str))
    pred = normalize_final_answer(matches[-1] if matches else INVALID)
    if gt_need_extract:
        boxed = last_boxed_only_string(_require_str("gt", gt))
        if boxed is None:
            raise ValueError(f"gt_need_extract=True but gt has no \\boxed{{...}}: {gt!r}")
        gt = remove_boxed(boxed)
    return pred == normalize_final_answer(_require_str("gt", gt)), pred


def is_correct_strict_box(
    solution_str: str, gt: str, pause_tokens_index: Sequence[int] | None = None
) -> tuple[bool, str | None]:
    """Compare the last ``\\boxed{}`` near the end of `solution_str` with `gt` verbatim.

    Looks at the last 100 characters, or, given `pause_tokens_index` (exactly four indices), at
    ``solution_str[pause_tokens_index[-1] - 100:]`` (Python slicing, so a negative start counts from
    the end). Returns ``(correct, box contents or None)``.
    """
    _require_str("solution_str", solution_str)
    _require_str("gt", gt)
    if pause_tokens_index is None:
        start = -BOX_TAIL_CHARS
    else:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must have 4 entries, got {len(pause_tokens_index)}")
        start = operator.index(pause_tokens_index[-1]) - BOX_TAIL_CHARS
    boxed = last_boxed_only_string(solution_str[start:])
    pred = None if boxed is None else remove_boxed(boxed)
    return pred == gt, pred


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Sequence[int] | None = None,
    *,
    boxed_fallback: bool = False,
) -> dict:
    """DAPO reward of one response: ``{"score": +1.0 or -1.0, "acc": bool, "pred": str | None}``.

    Only the last 300 characters of `solution_str` are used (`pause_tokens_index` indexes into that
    tail). Default mode is `is_correct_minerva`; ``strict_box_verify=True`` uses
    `is_correct_strict_box`, whose ``pred`` is None when there is no box. `boxed_fallback` (default
    mode only): an ``"[INVALID]"`` prediction gives way to the strict-box result when a box is found.
    """
    tail = _require_str("solution_str", solution_str)[-SOLUTION_TAIL_CHARS:]
    _require_str("ground_truth", ground_truth)
    if strict_box_verify:
        correct, pred = is_correct_strict_box(tail, ground_truth, pause_tokens_index)
    else:
        correct, pred = is_correct_minerva(tail, ground_truth)
        if boxed_fallback and pred == INVALID:
            box_correct, box_pred = is_correct_strict_box(tail, ground_truth, pause_tokens_index)
            if box_pred is not None:
                correct, pred = box_correct, box_pred
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def reward_rule(boxed_fallback: bool) -> dict:
    """The receipt's "reward_rule" section: which rule scored the samples, with which setting."""
    return {"name": RULE_NAME, "reference": RULE_REFERENCE, "boxed_fallback": bool(boxed_fallback)}
