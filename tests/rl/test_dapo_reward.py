"""DAPO math rule reward: exact (score, acc, pred) against verl `math_dapo.compute_score` semantics.

Expected values were worked out by hand from the reference behaviour (and cross-checked against it).
"""

import os

import pytest

from glm52_jax.rl.rewards import dapo
from glm52_jax.rl.rewards.dapo import (
    compute_score,
    is_correct_minerva,
    is_correct_strict_box,
    last_boxed_only_string,
    normalize_final_answer,
    remove_boxed,
)

HALF = "\\frac{1}{2}"

# (id, solution, ground_truth, expected_score, expected_pred) in the default (Minerva) mode.
MINERVA_CASES = [
    # extraction of the "Answer:" line
    ("plain", "Answer: 42", "42", 1.0, "42"),
    ("plain_wrong", "Answer: 41", "42", -1.0, "41"),
    ("lowercase", "answer: 42", "42", 1.0, "42"),
    ("uppercase_no_space", "ANSWER:42", "42", 1.0, "42"),
    ("space_before_colon", "Answer : 42", "42", 1.0, "42"),
    ("answer_on_next_line", "Answer:\n42", "42", 1.0, "42"),
    ("final_answer_prefix", "Final Answer: 42", "42", 1.0, "42"),
    ("reasoning_then_answer", "We add 40 and 2.\nAnswer: 42", "42", 1.0, "42"),
    ("rest_of_line_only", "Answer: 42\nSo we are done.", "42", 1.0, "42"),
    ("no_colon", "The answer is 42", "42", -1.0, "[INVALID]"),
    ("answer_is_colon", "Answer is: 42", "42", -1.0, "[INVALID]"),
    ("answers_plural", "Answers: 42", "42", -1.0, "[INVALID]"),
    ("empty_solution", "", "42", -1.0, "[INVALID]"),
    ("empty_both", "", "", -1.0, "[INVALID]"),
    ("answer_colon_nothing", "Answer:", "42", -1.0, "[INVALID]"),
    ("answer_colon_newline_only", "Answer:\n", "42", -1.0, "[INVALID]"),
    ("answer_trailing_space", "Answer: ", "42", -1.0, ""),
    ("answer_trailing_space_empty_gt", "Answer: ", "", 1.0, ""),
    ("answer_trailing_spaces", "Answer:   ", "", 1.0, ""),
    ("no_answer_gt_invalid_literal", "no answer here", "[INVALID]", 1.0, "[INVALID]"),
    ("literal_invalid_answer", "Answer: [INVALID]", "42", -1.0, "[INVALID]"),
    ("last_of_two", "Answer: 1\nAnswer: 2", "2", 1.0, "2"),
    ("last_of_two_gt_first", "Answer: 1\nAnswer: 2", "1", -1.0, "2"),
    ("last_of_three_mixed_case", "answer: 3\nANSWER: 4\nAnswer: 5", "5", 1.0, "5"),
    ("empty_line_swallows_next", "Answer:\n\nAnswer: 5", "5", -1.0, "Answer:5"),
    ("markdown_bold_label", "**Answer:** 42", "42", -1.0, "**42"),
    ("markdown_bold_value", "Answer: **42**", "42", -1.0, "**42**"),
    ("trailing_text_kept", "Answer: 42 (mod 7)", "42", -1.0, "42(mod7)"),
    ("trailing_quad", "Answer: 42 \\quad", "42", -1.0, "42\\quad"),
    # trailing punctuation
    ("trailing_period", "Answer: 42.", "42", -1.0, "42."),
    ("trailing_period_gt_too", "Answer: 42.", "42.", 1.0, "42."),
    ("period_before_dollar", "Answer: 7.$", "7", 1.0, "7"),
    ("period_inside_math", "Answer: $42.$", "42", 1.0, "42"),
    # dollars and boxes
    ("inline_math", "Answer: $42$", "42", 1.0, "42"),
    ("boxed", "Answer: \\boxed{42}", "42", 1.0, "42"),
    ("boxed_in_math", "Answer: $\\boxed{42}$", "42", 1.0, "42"),
    ("boxed_math_period", "ANSWER: $\\boxed{-7}$.", "-7", 1.0, "-7"),
    ("boxed_frac", "Answer: \\boxed{\\frac{1}{2}}", HALF, 1.0, HALF),
    ("two_boxes_greedy", "Answer: \\boxed{1} and \\boxed{2}", "2", -1.0, "1}and\\boxed{2"),
    ("first_math_span_only", "Answer: $5$ and $6$", "5", 1.0, "5"),
    ("equation_in_math", "Answer: $x = 5$", "5", 1.0, "5"),
    ("escaped_dollar", "Answer: \\$12", "12", 1.0, "12"),
    ("escaped_dollar_thousands", "Answer: \\$1,000", "1000", 1.0, "1000"),
    ("gt_boxed", "Answer: 42", "\\boxed{42}", 1.0, "42"),
    ("gt_padded", "Answer: 42", " 42 ", 1.0, "42"),
    # equations
    ("x_equals", "Answer: x = 5", "5", 1.0, "5"),
    ("gt_x_equals", "Answer: x=5", "x=5", 1.0, "5"),
    ("chained_equals", "Answer: a = b = 7", "7", 1.0, "7"),
    # numbers
    ("negative", "Answer: -3", "-3", 1.0, "-3"),
    ("negative_spaced", "Answer: - 3", "-3", 1.0, "-3"),
    ("negative_vs_positive", "Answer: -3", "3", -1.0, "-3"),
    ("thousands_comma", "Answer: 1,000", "1000", 1.0, "1000"),
    ("gt_thousands_comma", "Answer: 1000", "1,000", 1.0, "1000"),
    ("million_commas", "Answer: 1,000,000", "1000000", 1.0, "1000000"),
    ("negative_comma_kept", "Answer: -1,000", "-1000", -1.0, "-1,000"),
    ("brace_comma", "Answer: 1{,}000", "1000", 1.0, "1000"),
    ("thin_space_comma", "Answer: 1,\\!000", "1000", 1.0, "1000"),
    ("escaped_space", "Answer: 12\\ 000", "12000", 1.0, "12000"),
    ("thick_space", "Answer: 12\\;000", "12000", 1.0, "12000"),
    ("spaced_digits", "Answer: 4 2", "42", 1.0, "42"),
    ("leading_zero", "Answer: 042", "42", -1.0, "042"),
    ("decimal_zero", "Answer: 42.0", "42", -1.0, "42.0"),
    ("decimal", "Answer: 3.14", "3.14", 1.0, "3.14"),
    ("decimal_vs_frac", "Answer: 1.5", "\\frac{3}{2}", -1.0, "1.5"),
    ("list_merged", "Answer: 1, 2, 3", "123", 1.0, "123"),
    ("pair_merged", "Answer: 3, 4", "3,4", 1.0, "34"),
    ("tuple_kept", "Answer: (3, 4)", "(3,4)", 1.0, "(3,4)"),
    # fractions and roots
    ("frac_shorthand", "Answer: \\frac12", HALF, 1.0, HALF),
    ("gt_frac_shorthand", "Answer: \\frac{3}{4}", "\\frac34", 1.0, "\\frac{3}{4}"),
    ("dfrac_vs_frac", "Answer: \\dfrac12", HALF, -1.0, "\\dfrac{1}{2}"),
    ("dfrac_both", "Answer: \\dfrac{1}{2}", "\\dfrac12", 1.0, "\\dfrac{1}{2}"),
    ("frac_three_digits", "Answer: \\frac123", "\\frac{12}{3}", -1.0, "\\frac{1}{2}3"),
    ("slash_vs_frac", "Answer: 1/2", HALF, -1.0, "1/2"),
    ("negative_frac", "Answer: $-\\frac{1}{2}$", "-\\frac12", 1.0, "-\\frac{1}{2}"),
    ("sqrt_shorthand", "Answer: \\sqrt2", "\\sqrt{2}", 1.0, "\\sqrt{2}"),
    ("coef_sqrt", "Answer: 2\\sqrt3", "2\\sqrt{3}", 1.0, "2\\sqrt{3}"),
    ("gt_sqrt_shorthand", "Answer: \\sqrt{2}", "\\sqrt2", 1.0, "\\sqrt{2}"),
    ("sqrt_in_frac", "Answer: \\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", 1.0, "\\frac{\\sqrt{3}}{2}"),
    # units
    ("meters", "Answer: 5 meters", "5", 1.0, "5"),
    ("cm", "Answer: 5 cm", "5", 1.0, "5"),
    ("text_cm", "Answer: 5 \\text{cm}", "5", 1.0, "5"),
    ("text_space_cm", "Answer: 5 \\text{ cm}", "5", 1.0, "5"),
    ("text_m", "Answer: 10 \\text{m}", "10", 1.0, "10"),
    ("mbox_m", "Answer: 3\\mbox{m}", "3", 1.0, "3"),
    ("inches", "Answer: 5 inches", "5", 1.0, "5"),
    ("hours", "Answer: 3 hours", "3", 1.0, "3"),
    ("mph", "Answer: 60 mph", "60", 1.0, "60"),
    ("dollars", "Answer: 12 dollars", "12", 1.0, "12"),
    ("points", "Answer: 7 points", "7", 1.0, "7"),
    ("feet", "Answer: 15 feet", "15", 1.0, "15"),
    ("ways", "Answer: 8 ways", "8", 1.0, "8"),
    ("students", "Answer: 20 students", "20", 1.0, "20"),
    ("minutes", "Answer: 45 minutes", "45", 1.0, "45"),
    ("digits", "Answer: 3 digits", "3", 1.0, "3"),
    ("cents", "Answer: 25 cents", "25", 1.0, "25"),
    ("km", "Answer: 10 km", "10", 1.0, "10"),
    ("edges", "Answer: 4 edges", "4", 1.0, "4"),
    ("pounds", "Answer: 2 pounds", "2", 1.0, "2"),
    ("integers", "Answer: 9 integers", "9", 1.0, "9"),
    ("gm", "Answer: 5 gm", "5", 1.0, "5"),
    ("meals", "Answer: 3 meals", "3", 1.0, "3"),
    ("multiples", "Answer: 7 multiples", "7", 1.0, "7"),
    ("children_tickets", "Answer: 11 children tickets", "11", 1.0, "11"),
    ("text_units_squared", "Answer: 4 \\text{units}^2", "4", 1.0, "4"),
    ("text_cm_cubed", "Answer: 8 \\text{cm}^3", "8", 1.0, "8"),
    ("text_square_units", "Answer: 6 \\text{ square units}", "6", 1.0, "6"),
    ("text_square_meters", "Answer: 100 \\text{ square meters}", "100", 1.0, "100"),
    ("text_s", "Answer: 12 \\text{s}", "12", 1.0, "12"),
    ("text_period", "Answer: 3 \\text{.}", "3", 1.0, "3"),
    ("ldots", "Answer: 3 \\ldots", "3", 1.0, "3"),
    ("dots_list", "Answer: 1, 2, \\dots", "12", 1.0, "12"),
    ("mathrm_th", "Answer: 5\\mathrm{th}", "5", 1.0, "5"),
    ("th_plain_kept", "Answer: 5th", "5", -1.0, "5th"),
    ("sue_inside_word", "Answer: issue 4", "4", -1.0, "is4"),
    ("capital_sue_kept", "Answer: Sue", "Sue", 1.0, "Sue"),
    # degrees and percent
    ("degrees_word", "Answer: 45 degrees", "45", 1.0, "45"),
    ("circ", "Answer: 45^\\circ", "45", 1.0, "45"),
    ("braced_circ", "Answer: 45^{\\circ}", "45", 1.0, "45"),
    ("degree_sign_kept", "Answer: 90°", "90", -1.0, "90°"),
    ("degree_sign_both", "Answer: 90°", "90°", 1.0, "90°"),
    ("escaped_percent_kept", "Answer: 50\\%", "50", -1.0, "50\\%"),
    ("percent_both", "Answer: 50%", "50%", 1.0, "50%"),
    # text wrappers and articles
    ("text_choice", "Answer: \\text{(B)}", "(B)", 1.0, "(B)"),
    ("textbf_choice", "Answer: \\textbf{(C)}", "(C)", 1.0, "(C)"),
    ("overline", "Answer: \\overline{AB}", "AB", 1.0, "AB"),
    ("mbox_word", "Answer: \\mbox{yes}", "yes", 1.0, "yes"),
    ("text_word", "Answer: \\text{Monday}", "Monday", 1.0, "Monday"),
    ("text_and", "Answer: 2 \\text{and} 3", "2,3", 1.0, "23"),
    ("comma_text_and", "Answer: 2, \\text{and} 3", "2,3", 1.0, "23"),
    ("quotes", 'Answer: "42"', "42", 1.0, "42"),
    ("article_a", "Answer: a 6", "6", 1.0, "6"),
    ("article_an", "Answer: an 8", "8", 1.0, "8"),
    ("article_eats_word_tail", "Answer: pizza box", "pizza box", 1.0, "pizzbox"),
]

# (id, solution, ground_truth, expected_score, expected_pred) with strict_box_verify=True.
STRICT_CASES = [
    ("boxed", "so \\boxed{42}", "42", 1.0, "42"),
    ("boxed_wrong", "so \\boxed{41}", "42", -1.0, "41"),
    ("no_box", "no box here", "42", -1.0, None),
    ("empty_solution", "", "42", -1.0, None),
    ("answer_line_ignored", "Answer: 42", "42", -1.0, None),
    ("inner_spaces_not_normalised", "\\boxed{ 42 }", "42", -1.0, " 42 "),
    ("gt_not_normalised", "\\boxed{42}", " 42", -1.0, "42"),
    ("gt_boxed_not_extracted", "\\boxed{42}", "\\boxed{42}", -1.0, "42"),
    ("units_kept", "\\boxed{5 \\text{cm}}", "5", -1.0, "5 \\text{cm}"),
    ("last_box_wins", "\\boxed{1} then \\boxed{2}", "2", 1.0, "2"),
    ("last_box_wins_gt_first", "\\boxed{1} then \\boxed{2}", "1", -1.0, "2"),
    ("nested_braces", "\\boxed{\\frac{1}{2}}", HALF, 1.0, HALF),
    ("unbalanced", "\\boxed{\\frac{1}{2}", HALF, -1.0, None),
    ("empty_box", "\\boxed{}", "", 1.0, ""),
    ("box_in_math_with_period", "$\\boxed{42}$.", "42", 1.0, "42"),
    ("fbox_not_recognised", "\\fbox{42}", "42", -1.0, None),
    ("box_without_brace", "\\boxed 42", "42", -1.0, None),
    ("box_exactly_in_last_100", "\\boxed{42}" + "x" * 90, "42", 1.0, "42"),
    ("box_cut_by_last_100", "\\boxed{42}" + "x" * 91, "42", -1.0, None),
    ("box_before_last_100", "\\boxed{42}" + "x" * 100, "42", -1.0, None),
    ("negative", "\\boxed{-3}", "-3", 1.0, "-3"),
    ("frac_shorthand_not_expanded", "\\boxed{\\frac12}", HALF, -1.0, "\\frac12"),
]


def _check(result, score, pred):
    assert set(result) == {"score", "acc", "pred"}
    assert type(result["score"]) is float and result["score"] == score
    assert type(result["acc"]) is bool and result["acc"] is (score > 0)
    assert result["pred"] == pred


@pytest.mark.parametrize("solution, gt, score, pred", [c[1:] for c in MINERVA_CASES], ids=[c[0] for c in MINERVA_CASES])
def test_minerva_table(solution, gt, score, pred):
    _check(compute_score(solution, gt), score, pred)


@pytest.mark.parametrize("solution, gt, score, pred", [c[1:] for c in STRICT_CASES], ids=[c[0] for c in STRICT_CASES])
def test_strict_box_table(solution, gt, score, pred):
    _check(compute_score(solution, gt, strict_box_verify=True), score, pred)


def test_case_ids_are_distinct():
    for table in (MINERVA_CASES, STRICT_CASES):
        assert len({c[0] for c in table}) == len(table)
        assert len({c[1:3] for c in table}) == len(table)
    assert len(MINERVA_CASES) + len(STRICT_CASES) >= 100


# ---------------------------------------------------------------- last-300-character window


@pytest.mark.parametrize(
    "solution, gt, score, pred",
    [
        ("Answer: 42\n" + "x" * 300, "42", -1.0, "[INVALID]"),  # answer entirely before the window
        ("Answer: 42\n" + "x" * 289, "42", 1.0, "42"),  # 300 characters: fully inside
        ("Answer: 42\n" + "y" * 290, "42", -1.0, "[INVALID]"),  # 301: the "A" is cut, "nswer:" fails
        ("Answer: 1\n" + "z" * 400 + "\nAnswer: 2", "1", -1.0, "2"),  # early answer outside, late inside
        ("Answer: 1\n" + "z" * 400 + "\nAnswer: 2", "2", 1.0, "2"),
        ("x" * 1000 + "Answer: 42", "42", 1.0, "42"),
    ],
    ids=["outside", "boundary_300", "boundary_301", "late_wins_gt1", "late_wins_gt2", "long_prefix"],
)
def test_last_300_characters(solution, gt, score, pred):
    _check(compute_score(solution, gt), score, pred)


def test_strict_box_window_is_inside_300_tail():
    # 500 filler characters, then the box: the box is in the last 100 of the 300-character tail.
    _check(compute_score("q" * 500 + "\\boxed{9}", "9", strict_box_verify=True), 1.0, "9")
    _check(compute_score("\\boxed{9}" + "q" * 300, "9", strict_box_verify=True), -1.0, None)


# ---------------------------------------------------------------- pause_tokens_index


def test_pause_tokens_index_sets_window_start():
    sol = "\\boxed{7}" + "y" * 150  # the box is characters 0..8
    _check(compute_score(sol, "7", True, [0, 0, 0, 100]), 1.0, "7")  # start 0: whole string
    _check(compute_score(sol, "7", True, (5, 6, 7, 100)), 1.0, "7")  # any 4-sequence; only [-1] is used
    _check(compute_score(sol, "7", True, [0, 0, 0, 101]), -1.0, None)  # start 1: the backslash is cut
    _check(compute_score(sol, "7", True, [0, 0, 0, 250]), -1.0, None)  # start past the end: empty


def test_pause_tokens_index_negative_start_counts_from_end():
    # pause index 5 -> start -95: the last 95 characters (Python slicing).
    _check(compute_score("\\boxed{7}" + "y" * 86, "7", True, [1, 2, 3, 5]), 1.0, "7")  # 95 chars: all in
    _check(compute_score("\\boxed{7}" + "y" * 90, "7", True, [1, 2, 3, 5]), -1.0, None)  # 99 chars: cut


def test_pause_tokens_index_indexes_the_300_tail():
    sol = "z" * 500 + "\\boxed{9}" + "w" * 20  # tail = "z" * 271 + box + "w" * 20
    _check(compute_score(sol, "9", True, [0, 0, 0, 371]), 1.0, "9")  # tail[271:] starts at the box
    _check(compute_score(sol, "9", True, [0, 0, 0, 600]), -1.0, None)  # full-string index: past the tail


def test_pause_tokens_index_must_have_four_entries():
    with pytest.raises(ValueError, match="4 entries"):
        compute_score("\\boxed{7}", "7", True, [0, 100])
    with pytest.raises(TypeError):
        compute_score("\\boxed{7}", "7", True, [0, 0, 0, 1.5])


def test_pause_tokens_index_ignored_in_minerva_mode():
    _check(compute_score("Answer: 3", "3", False, [1]), 1.0, "3")


# ---------------------------------------------------------------- normalize_final_answer, step by step

SPEC_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
SPEC_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)


def test_tables_match_spec():
    assert dapo.SUBSTITUTIONS == SPEC_SUBSTITUTIONS
    assert dapo.REMOVED_EXPRESSIONS == SPEC_REMOVED
    assert dapo.ANSWER_RE.pattern == r"(?i)Answer\s*:\s*([^\n]+)"


@pytest.mark.parametrize("expr", SPEC_REMOVED)
def test_each_removed_expression(expr):
    assert normalize_final_answer("7" + expr) == "7"


@pytest.mark.parametrize(
    "raw, expected",
    [
        # 1. keep the text after the last "="
        ("x = 3", "3"),
        ("a=b=c", "c"),
        ("3=", ""),
        # 2. literal substitutions, in order
        ("an apple", "apple"),
        ("a cat", "cat"),
        ("5.$", "5"),
        ("\\$5", "5"),
        ("1\\ 2", "12"),
        (" 1 2 3 ", "123"),
        ("3\\mbox{m}", "3"),  # mbox -> text, then \text{m} -> \text{}, then removed
        ("1,\\text{and}2", "12"),
        ("\\text{and}", ","),
        # 3. removals: the newline entries need a real newline
        ("7\\text{\ns}", "7"),
        ("7\\text{\\ns}", "7\\ns"),
        # 4. regex rewrites
        ("$1$ and $2$", "1"),
        ("\\text{foo}", "foo"),
        ("\\textbf{x}", "x"),
        ("\\overline{12}", "12"),
        ("\\boxed{\\boxed{3}}", "\\boxed{3}"),  # one greedy pass
        ("\\text{a}\\text{b}", "ab"),  # non-greedy, every occurrence
        # 5. TeX shorthand
        ("\\frac12", HALF),
        ("\\frac1{2}", "\\frac{1}{{}2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\sqrt23", "\\sqrt{2}3"),
        ("\\sqrt{2}", "\\sqrt{2}"),
        # 6./7. dollars and digit commas
        ("$$", ""),
        ("1,000", "1000"),
        ("1,2,3", "123"),
        ("-1,000", "-1,000"),
        ("1.5,2", "1.5,2"),
        (",,,", ",,,"),
        # 8. strip (tabs and newlines survive the space removal until here)
        ("\t42\n", "42"),
        ("4\t2", "4\t2"),
        ("", ""),
        ("[INVALID]", "[INVALID]"),
    ],
)
def test_normalize_final_answer_steps(raw, expected):
    assert normalize_final_answer(raw) == expected


# ---------------------------------------------------------------- box helpers and mode helpers


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a \\boxed{1} b \\boxed{2} c", "\\boxed{2}"),
        ("\\boxed{a{b}c} tail", "\\boxed{a{b}c}"),
        ("\\boxed{1}}", "\\boxed{1}"),
        ("\\boxed{", None),
        ("\\boxed{{1}", None),
        ("", None),
        ("boxed{1}", None),
    ],
)
def test_last_boxed_only_string(text, expected):
    assert last_boxed_only_string(text) == expected


def test_remove_boxed():
    assert remove_boxed("\\boxed{42}") == "42"
    assert remove_boxed("\\boxed{}") == ""
    assert remove_boxed("\\boxed{a{b}}") == "a{b}"
    for bad in ("boxed{42}", "\\boxed{42", "\\boxed{", ""):
        with pytest.raises(ValueError, match="boxed"):
            remove_boxed(bad)


def test_is_correct_minerva():
    assert is_correct_minerva("Answer: 5 cm", "5") == (True, "5")
    assert is_correct_minerva("Answer: 6", "5") == (False, "6")
    assert is_correct_minerva("Answer: 5", "so \\boxed{5}", gt_need_extract=True) == (True, "5")
    assert is_correct_minerva("Answer: 5", "so \\boxed{5 \\text{cm}}.", gt_need_extract=True) == (True, "5")
    with pytest.raises(ValueError, match="boxed"):
        is_correct_minerva("Answer: 5", "5", gt_need_extract=True)


def test_is_correct_strict_box():
    assert is_correct_strict_box("\\boxed{5}", "5") == (True, "5")
    assert is_correct_strict_box("\\boxed{5}", "6") == (False, "5")
    assert is_correct_strict_box("nothing", "5") == (False, None)


# ---------------------------------------------------------------- argument checking


@pytest.mark.parametrize(
    "call",
    [
        lambda: compute_score(None, "1"),
        lambda: compute_score(b"Answer: 1", "1"),
        lambda: compute_score("Answer: 1", 1),
        lambda: compute_score("\\boxed{1}", None, strict_box_verify=True),
        lambda: normalize_final_answer(42),
        lambda: last_boxed_only_string(None),
        lambda: remove_boxed(["\\boxed{1}"]),
    ],
)
def test_non_str_inputs_raise_type_error(call):
    with pytest.raises(TypeError, match="must be a str"):
        call()


# ---------------------------------------------------------------- boxed_fallback (verl 0.9.1's rule)

INVALID = "[INVALID]"
# (id, solution, ground_truth, pause_tokens_index, (score, pred) without the fallback, (score, pred) with it).
FALLBACK_CASES = [
    ("box_only", "so \\boxed{7}", "7", None, (-1.0, INVALID), (1.0, "7")),
    ("box_only_wrong", "so \\boxed{8}", "7", None, (-1.0, INVALID), (-1.0, "8")),
    ("final_answer_box", "The final answer is $\\boxed{42}$.", "42", None, (-1.0, INVALID), (1.0, "42")),
    ("no_answer_no_box", "no answer here", "7", None, (-1.0, INVALID), (-1.0, INVALID)),
    ("answer_line_wins", "Answer: 7\n\\boxed{8}", "7", None, (1.0, "7"), (1.0, "7")),
    ("wrong_answer_line_wins", "Answer: 6\n\\boxed{7}", "7", None, (-1.0, "6"), (-1.0, "6")),
    ("answer_box_next_line", "Answer:\n\\boxed{7}", "7", None, (1.0, "7"), (1.0, "7")),
    # The fallback tests the normalised prediction: a literal "[INVALID]" answer gives way to the box too.
    ("literal_invalid_answer", "Answer: [INVALID]\n\\boxed{7}", "7", None, (-1.0, INVALID), (1.0, "7")),
    ("invalid_gt_no_box", "nothing", INVALID, None, (1.0, INVALID), (1.0, INVALID)),
    ("box_verbatim_spaces", "\\boxed{ 7 }", "7", None, (-1.0, INVALID), (-1.0, " 7 ")),
    ("box_not_normalised", "\\boxed{\\frac12}", HALF, None, (-1.0, INVALID), (-1.0, "\\frac12")),
    ("gt_box_not_extracted", "\\boxed{7}", "\\boxed{7}", None, (-1.0, INVALID), (-1.0, "7")),
    ("unclosed_box", "so \\boxed{7", "7", None, (-1.0, INVALID), (-1.0, INVALID)),
    ("empty_box_empty_gt", "\\boxed{}", "", None, (-1.0, INVALID), (1.0, "")),
    ("box_before_last_100", "\\boxed{7}" + "x" * 100, "7", None, (-1.0, INVALID), (-1.0, INVALID)),
    ("box_in_300_tail", "y" * 500 + "\\boxed{7}", "7", None, (-1.0, INVALID), (1.0, "7")),
    ("pause_window_whole", "\\boxed{7}" + "y" * 150, "7", [0, 0, 0, 100], (-1.0, INVALID), (1.0, "7")),
    ("pause_window_cuts_box", "\\boxed{7}" + "y" * 150, "7", [0, 0, 0, 101], (-1.0, INVALID), (-1.0, INVALID)),
]


STRICT_CASES_INPUTS = [(c[1], c[2], None) for c in STRICT_CASES]  # (solution, ground truth, pause index)


@pytest.mark.parametrize("solution, gt, pause, off, on", [c[1:] for c in FALLBACK_CASES],
                         ids=[c[0] for c in FALLBACK_CASES])
def test_boxed_fallback_table(solution, gt, pause, off, on):
    _check(compute_score(solution, gt, False, pause), *off)  # the default is the seed's rule
    _check(compute_score(solution, gt, False, pause, boxed_fallback=False), *off)
    _check(compute_score(solution, gt, False, pause, boxed_fallback=True), *on)


def test_boxed_fallback_leaves_strict_mode_and_checks_pause_only_when_used():
    for sol, gt, _ in STRICT_CASES_INPUTS:
        assert compute_score(sol, gt, True, boxed_fallback=True) == compute_score(sol, gt, True)
    _check(compute_score("Answer: 7", "7", False, [1], boxed_fallback=True), 1.0, "7")  # no fallback: not read
    with pytest.raises(ValueError, match="4 entries"):
        compute_score("\\boxed{7}", "7", False, [1], boxed_fallback=True)


def test_reward_rule_record():
    assert dapo.reward_rule(True) == {"name": "dapo", "reference": dapo.RULE_REFERENCE, "boxed_fallback": True}
    assert dapo.reward_rule(False)["boxed_fallback"] is False


# ---------------------------------------------------------------- against verl's own module


def _verl_references():
    """verl's math_dapo modules to compare with: each path of $GLM52_VERL_MATH_DAPO (os.pathsep-separated,
    e.g. the 0.9.0 and 0.9.1 wheels), else an installed verl; skips when there is none."""
    from benchmarks import reward_vs_verl

    paths = [p for p in os.environ.get(reward_vs_verl.ENV_VAR, "").split(os.pathsep) if p] or [None]
    try:
        return [reward_vs_verl.load_reference(p) for p in paths]
    except reward_vs_verl.ReferenceUnavailable as e:
        pytest.skip(f"verl's math_dapo.py is not in this environment ({e}); the 400k-input comparison is "
                    "`python -m benchmarks.reward_vs_verl --verl WHEEL`")


def test_matches_verl_math_dapo_on_random_inputs():
    """A small run of `benchmarks/reward_vs_verl.py` (the seed's rule, boxed_fallback=False) per reference:
    every seeded input scores the same in both modes, and the normaliser agrees; with verl >= 0.9.1 the only
    differences are its `\\boxed{}` fallback."""
    from benchmarks import reward_vs_verl

    for reference in _verl_references():
        res = reward_vs_verl.compare(reference, n=3000, seed=1)
        assert res["unexplained_mismatches"] == 0, res["examples"]
        if not res["reference"]["has_boxed_fallback"]:
            assert all(s["mismatches"] == 0 for s in res["modes"].values()), res["modes"]


def _outcome(fn, *args, **kwargs):
    try:
        result = fn(*args, **kwargs)
    except (AssertionError, ValueError, TypeError, AttributeError):  # both sides must fail on the same inputs
        return "raised"
    return result


def test_both_settings_match_verl_on_the_corpus():
    """Default mode on the tables above plus 3,000 seeded inputs, score, acc and pred (with types) equal to verl's
    own code: boxed_fallback=True against verl >= 0.9.1's compute_score, and boxed_fallback=False against verl
    <= 0.9.0's compute_score or, in 0.9.1, against its `is_correct_minerva` (the rule before the fallback)."""
    from benchmarks import reward_vs_verl

    corpus = [(c[1], c[2], None) for c in MINERVA_CASES] + STRICT_CASES_INPUTS
    corpus += [(c[1], c[2], c[3]) for c in FALLBACK_CASES]
    corpus += [(sol, gt, pause) for sol, gt, pause, _ in reward_vs_verl.cases(3000, seed=2)]
    for reference in _verl_references():
        fallback = reward_vs_verl.has_boxed_fallback(reference)
        compared = 0
        for sol, gt, pause in corpus:
            ours = _outcome(compute_score, sol, gt, False, pause, boxed_fallback=fallback)
            theirs = _outcome(reference.compute_score, sol, gt, False, pause)
            assert ours == theirs and (ours == "raised" or type(ours["acc"]) is type(theirs["acc"])), \
                (reference.SOURCE, sol, gt, pause, ours, theirs)
            if fallback:  # the other setting, against the same module's pre-fallback rule
                correct, pred = reference.is_correct_minerva(sol[-dapo.SOLUTION_TAIL_CHARS:], gt)
                ours = compute_score(sol, gt, False, pause, boxed_fallback=False)
                assert (ours["acc"], ours["pred"]) == (correct, pred), (reference.SOURCE, sol, gt, ours)
            compared += 1
        assert compared == len(corpus) > 3100


def test_random_inputs_are_seeded_and_reach_every_outcome():
    """The benchmark's inputs (no verl needed): the same for a seed, and they reach both scores in both
    modes, missing answer lines, missing boxes, the 300-character cut and malformed pause indices."""
    from benchmarks import reward_vs_verl

    inputs = list(reward_vs_verl.cases(2000, seed=3))
    assert inputs == list(reward_vs_verl.cases(2000, seed=3)) != list(reward_vs_verl.cases(2000, seed=4))
    minerva = [compute_score(sol, gt) for sol, gt, _, _ in inputs]
    strict = []
    for sol, gt, pause, _ in inputs:
        try:
            strict.append(compute_score(sol, gt, strict_box_verify=True, pause_tokens_index=pause))
        except ValueError:
            strict.append(None)  # a pause_tokens_index without 4 entries

    def share(flags):
        return sum(flags) / len(inputs)

    assert 0.2 < share(r["score"] == 1.0 for r in minerva) < 0.8
    assert share(r["pred"] == "[INVALID]" for r in minerva) > 0.1
    assert share(r is not None and r["score"] == 1.0 for r in strict) > 0.05
    assert share(r is not None and r["pred"] is None for r in strict) > 0.1
    assert share(r is None for r in strict) > 0.01
    assert share(len(sol) > dapo.SOLUTION_TAIL_CHARS for sol, *_ in inputs) > 0.2
    assert len({r["pred"] for r in minerva}) > 500
