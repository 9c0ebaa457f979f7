"""DAPO row loading: the shipped problem set (answers re-computed), validation, dedupe, selection."""

import ast
import json
import math
import operator
import re
import sys
from fractions import Fraction

import pytest

from glm52_jax.dapo_data import (
    DAPO_PROMPT_TEMPLATE,
    DapoFormatError,
    DapoRow,
    dapo_record,
    default_problems_path,
    load_rows,
    parse_row,
)

# ---- a small safe evaluator for extra_info["check"] (exact rational arithmetic) --------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _int(x):
    if Fraction(x).denominator != 1:
        raise ValueError(f"{x} is not an integer")
    return int(x)


_FUNCS = {"comb": lambda n, k: math.comb(_int(n), _int(k)), "factorial": lambda n: math.factorial(_int(n)),
          "gcd": lambda *a: math.gcd(*map(_int, a)), "lcm": lambda *a: math.lcm(*map(_int, a)),
          "isqrt": lambda n: math.isqrt(_int(n)), "abs": abs, "min": min, "max": max,
          "numerator": lambda x: Fraction(x).numerator, "denominator": lambda x: Fraction(x).denominator,
          "digit_sum": lambda n: sum(int(c) for c in str(abs(_int(n))))}


def safe_eval(expr: str) -> Fraction:
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                return Fraction(left) ** _int(right)
            return Fraction(_BINOPS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                and not node.keywords):
            return Fraction(_FUNCS[node.func.id](*[ev(a) for a in node.args]))
        raise ValueError(f"disallowed expression node {ast.dump(node)[:60]}")

    return ev(ast.parse(expr, mode="eval"))


def test_safe_eval_is_exact_and_closed():
    assert safe_eval("7*3 + 11*2") == 43
    assert safe_eval("80*125/100*90/100") == 90
    assert safe_eval("numerator(6/45) + denominator(6/45)") == 17
    assert safe_eval("-(100//2)") == -50
    for bad in ("__import__('os')", "open('x')", "(1).real", "[1][0]", "1.5 + 1", "x"):
        with pytest.raises(ValueError):
            safe_eval(bad)


# ---- the shipped problem set ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    return load_rows()


def test_shipped_rows_follow_dapo_schema(shipped):
    assert len(shipped) >= 60
    raw = [json.loads(line) for line in default_problems_path().read_text(encoding="utf-8").splitlines()]
    assert len(raw) == len(shipped)
    for i, (row, r) in enumerate(zip(shipped, raw)):
        assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row.index == i and row.uid == i and r["extra_info"]["index"] == i
        assert row.data_source == "math_dapo" and row.ability == "MATH" and row.reward_style == "rule-lm"
        assert len(row.prompt) == 1 and row.prompt[0]["role"] == "user"
        assert row.content == DAPO_PROMPT_TEMPLATE.format(problem=row.problem)
        assert row.problem and row.problem == row.problem.strip()
        assert re.fullmatch(r"-?(0|[1-9]\d*)", row.ground_truth), row.ground_truth
    assert len({r.problem for r in shipped}) == len(shipped)
    assert any(r.ground_truth.startswith("-") for r in shipped)  # negative answers occur, as in DAPO


def test_dapo_wording_is_exact():
    assert DAPO_PROMPT_TEMPLATE == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
        "Remember to put your answer on its own line after \"Answer:\".")


def test_shipped_answers_recomputed(shipped):
    for row in shipped:
        check = row.extra_info["check"]
        value = safe_eval(check)
        assert value.denominator == 1, (row.index, check, value)
        assert int(value) == int(row.ground_truth), (row.index, row.problem, check)


# ---- validation ----------------------------------------------------------------------------------

def _good(i=0, problem="What is 1+1?", answer="2"):
    return dapo_record(problem, answer, i)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_dapo_record_round_trip():
    row = parse_row(dapo_record("What is 6*7?", 42, "uid-1", check="6*7"), 5)
    assert row == DapoRow(index=5, prompt=({"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(
        problem="What is 6*7?")},), ground_truth="42", data_source="math_dapo", ability="MATH",
        reward_style="rule-lm", uid="uid-1", extra_info={"index": "uid-1", "check": "6*7"})
    assert row.problem == "What is 6*7?"
    assert row.messages == [dict(row.prompt[0])]
    plain = parse_row({"data_source": "x", "prompt": [{"role": "user", "content": "hi"}],
                       "reward_model": {"ground_truth": "1"}}, 0)
    assert plain.problem == "hi" and plain.uid is None and plain.ability is None and plain.extra_info == {}


def _drop(d, *keys):
    for k in keys[:-1]:
        d = d[k]
    del d[keys[-1]]


def _set(value, *keys):
    def f(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return f


@pytest.mark.parametrize("mutate, field, what", [
    (lambda r: _drop(r, "prompt"), "'prompt'", "missing"),
    (_set("just text", "prompt"), "'prompt'", "list of chat messages"),
    (_set([], "prompt"), "'prompt'", "empty"),
    (lambda r: _drop(r, "prompt", 0, "content"), "'prompt[0].content'", "missing"),
    (_set(7, "prompt", 0, "content"), "'prompt[0].content'", "must be a str, got int"),
    (_set(["user", "hi"], "prompt", 0), "'prompt[0]'", "must be an object"),
    (_set("assistant", "prompt", 0, "role"), "'prompt'", "no message with role 'user'"),
    (lambda r: _drop(r, "reward_model", "ground_truth"), "'reward_model.ground_truth'", "missing"),
    (_set(2, "reward_model", "ground_truth"), "'reward_model.ground_truth'", "must be a str, got int"),
    (_set("2", "reward_model"), "'reward_model'", "must be an object"),
    (lambda r: _drop(r, "data_source"), "'data_source'", "missing"),
    (_set(["math"], "data_source"), "'data_source'", "must be a str, got list"),
    (_set("x", "extra_info"), "'extra_info'", "must be an object"),
    (_set(1.5, "extra_info", "index"), "'extra_info.index'", "must be a str or int"),
    (_set(3, "ability"), "'ability'", "must be a str"),
])
def test_validation_names_row_and_field(tmp_path, mutate, field, what):
    bad = _good(2)
    mutate(bad)
    path = _write(tmp_path / "d.jsonl", [_good(0), _good(1, "What is 2+2?", "4"), bad])
    with pytest.raises(DapoFormatError) as e:
        load_rows(path)
    msg = str(e.value)
    assert msg.startswith("row 2 (d.jsonl line 3): field " + field), msg
    assert what in msg


def test_invalid_json_and_non_object(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(_good()) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(DapoFormatError, match=r"bad.jsonl line 3: invalid JSON"):
        load_rows(p)
    p.write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(DapoFormatError, match=r"row 0 .*expected an object, got list"):
        load_rows(p)


def test_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected .jsonl or .parquet"):
        load_rows(tmp_path / "x.csv")


# ---- dedupe and selection ------------------------------------------------------------------------

@pytest.fixture
def dup_file(tmp_path):
    a, b, c = ("What is 1+1?", "2"), ("What is 2+3?", "5"), ("What is 3*3?", "9")
    rows = [_good(0, *a), _good(1, *b), _good(2, a[0], "999"), _good(3, *c), _good(4, *b), _good(5, *a)]
    return _write(tmp_path / "dup.jsonl", rows)


def test_dedupe_keeps_first_occurrence(dup_file):
    all_rows = load_rows(dup_file)
    assert [r.index for r in all_rows] == [0, 1, 2, 3, 4, 5]
    uniq = load_rows(dup_file, dedupe=True)
    assert [r.index for r in uniq] == [0, 1, 3]
    assert [r.ground_truth for r in uniq] == ["2", "5", "9"]  # row 2's "999" duplicate prompt is dropped


def test_select(dup_file):
    assert [r.index for r in load_rows(dup_file, select=4)] == [4]
    assert [r.index for r in load_rows(dup_file, select=[5, 0, 5])] == [5, 0, 5]
    # positions refer to the de-duplicated list; DapoRow.index stays the file position
    assert [r.index for r in load_rows(dup_file, dedupe=True, select=[2, 0])] == [3, 0]
    with pytest.raises(IndexError, match="select index 3 out of range: 3 rows .* after de-duplication"):
        load_rows(dup_file, dedupe=True, select=3)
    with pytest.raises(IndexError, match="select index 6 out of range: 6 rows"):
        load_rows(dup_file, select=[0, 6])
    with pytest.raises(IndexError, match="select index -1"):
        load_rows(dup_file, select=-1)
    with pytest.raises(TypeError):
        load_rows(dup_file, select=["1"])
    assert len(load_rows(select=range(60))) == 60


# ---- parquet -------------------------------------------------------------------------------------

def test_parquet_without_pyarrow_says_how_to_fix(tmp_path, monkeypatch):
    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_rows(p)


def test_parquet_round_trip(tmp_path):
    # pyarrow is in the test extra: a missing install fails here rather than skipping the test.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_good(0), _good(1, "What is 2+3?", "5"), _good(2)]  # row 2 repeats row 0's prompt
    for r in rows:
        r["extra_info"]["index"] = f"uid-{r['extra_info']['index']}"
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p)
    got = load_rows(p, dedupe=True)
    assert [(r.index, r.uid, r.ground_truth) for r in got] == [(0, "uid-0", "2"), (1, "uid-1", "5")]
    # Every field (nested prompt messages, reward style, extra_info) reads as from the same rows in JSONL.
    assert load_rows(p) == load_rows(_write(tmp_path / "d.jsonl", rows)) == [parse_row(r, i) for i, r in
                                                                            enumerate(rows)]
    assert got[1].prompt == ({"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem="What is 2+3?")},)
