"""Our DAPO rule reward against verl's own `math_dapo.py` on seeded random inputs (differential test).

    .venv/bin/python -m benchmarks.reward_vs_verl --verl PATH [--n 400000] [--seed 0] [--out FILE]

PATH is a verl wheel (e.g. from `pip download verl==0.9.0 --no-deps -d /tmp/verl`), a directory that
holds `verl/utils/reward_score/math_dapo.py` (a source checkout or site-packages), or that file itself;
$GLM52_VERL_MATH_DAPO is the default, then an installed `verl` distribution. Only that one file is
loaded, as a standalone module (it needs `re` and `typing`): `import verl` itself pulls in ray,
tensordict and the rest of verl's dependencies.

Each input is a (solution, ground truth, pause_tokens_index) triple from a seeded generator: ground
truths of many answer kinds (integers with and without thousands commas, decimals, LaTeX fractions in
braced and shorthand form, roots, pi, degrees, units, money, intervals, equations, choice letters),
mutated into the predicted answer (spaces, `$...$`, `\\boxed{}`, `\\text{}`, unit words, trailing
punctuation, `x = ` prefixes, digit changes, fraction forms, stray LaTeX characters, another truth),
and written into a solution: answer-line variants (case, spacing, `Final Answer:`, markdown, the
answer on the next line, several answer lines, none), boxed answers (closed, unclosed, nested),
reasoning text before and after (so the 300- and 100-character windows cut through it) and whitespace
variants. Every input is scored in the default (Minerva) mode and in strict-box mode, and the
normaliser is compared on the raw answer too; results must be equal (score, acc, pred), or both
sides must raise.

verl <= 0.9.0 holds the reference semantics this project implements (`glm52_jax/rl/rewards/dapo.py`);
verl 0.9.1 adds a `\\boxed{}` fallback when no `Answer:` line is found. Mismatches that are exactly
that fallback are counted separately; any other mismatch is printed and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import sys
import time
import types
import zipfile
from pathlib import Path

from glm52_jax.rl.rewards import dapo

MODULE_PATH = "verl/utils/reward_score/math_dapo.py"
ENV_VAR = "GLM52_VERL_MATH_DAPO"
HOW_TO_GET = (f"pip download verl==0.9.0 --no-deps -d /tmp/verl, then --verl /tmp/verl/verl-0.9.0-py3-none-any.whl "
              f"(or set ${ENV_VAR} to that path)")


class ReferenceUnavailable(RuntimeError):
    """verl's math_dapo.py could not be found or loaded."""


# ------------------------------------------------------------------------------------------------
# Loading verl's module standalone.


def _find_source(path: str | os.PathLike | None) -> tuple[str, str]:
    """(source text, where it came from) of verl's math_dapo.py."""
    if path is None:
        path = os.environ.get(ENV_VAR) or None
    if path is None:
        spec = importlib.util.find_spec("verl")  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ReferenceUnavailable(f"verl's math_dapo.py not found: {HOW_TO_GET}")
        path = Path(next(iter(spec.submodule_search_locations))).parent
    path = Path(path)
    if path.is_file() and path.suffix == ".whl":
        with zipfile.ZipFile(path) as whl:
            try:
                return whl.read(MODULE_PATH).decode("utf-8"), f"{path}:{MODULE_PATH}"
            except KeyError:
                raise ReferenceUnavailable(f"{path} has no {MODULE_PATH}") from None
    if path.is_dir():
        path = path / MODULE_PATH
    if not path.is_file():
        raise ReferenceUnavailable(f"no verl math_dapo.py at {path}: {HOW_TO_GET}")
    return path.read_text(encoding="utf-8"), str(path)


def load_reference(path: str | os.PathLike | None = None) -> types.ModuleType:
    """verl's `math_dapo` as a standalone module; `.SOURCE` says where it came from, `.SHA256` its hash."""
    source, where = _find_source(path)
    module = types.ModuleType("verl_math_dapo")
    module.__file__ = where
    exec(compile(source, where, "exec"), module.__dict__)  # the reference under test
    if not callable(getattr(module, "compute_score", None)):
        raise ReferenceUnavailable(f"{where} defines no compute_score")
    module.SOURCE = where
    module.SHA256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
    return module


def has_boxed_fallback(reference) -> bool:
    """verl 0.9.1+: a boxed answer without an `Answer:` line is accepted."""
    return reference.compute_score("so \\boxed{7}", "7")["score"] == 1.0


# ------------------------------------------------------------------------------------------------
# Seeded inputs.

_WORDS = ("we", "so", "the", "sum", "is", "and", "thus", "hence", "a", "an", "Let", "x", "=", "+", "$x$", "\\frac",
          "{", "}", "$", "answer", "Answer", "boxed", "\\boxed{2}", "units", "cm", "\n", "\n\n", ".", ",", ":",
          "therefore", "\\text{m}", "squared", "total", "of", "3", "42", "-1", "\\sqrt{2}", "=", "ways")
_UNITS = (" cm", " meters", " degrees", "^\\circ", "^{\\circ}", "\\%", " dollars", "\\text{ cm}", " units",
          " square units", " mph", " inches", " points", " ways", "\\text{m}", " km", " students", "\\text{s}")
# LaTeX and unit text of the kinds answer normalisers strip or rewrite, inserted anywhere in an answer.
_SNIPPETS = (" hours", " feet", " minutes", " digits", " cents", " gm", " pounds", " meals", " edges", " sue",
             " childrentickets", " multiples", " integers", " seconds", "\\ldots", "\\dots", "\\cdots", "\\text{.}",
             "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{ }", "\\mathrm{th}", "\\mathrm{cm}",
             "\\;", "\\,", ",\\!", "{,}", '"', ",\\text{and}", "\\text{and}", "\\text{ and }", "\\ ", "\\text{m}",
             "mbox", "\\mbox{m}", "\\$", ".$", "an ", "a ", "^2", "^\\circ", "\\left(", "\\right)", "\\!")
_STRAY = "{}$\\=,.:^_ \n\t~!()[]"


def _int(rng: random.Random) -> str:
    n = rng.choice((rng.randint(-20, 20), rng.randint(0, 999), rng.randint(1000, 10**7)))
    return f"{n:,}" if n >= 1000 and rng.random() < 0.3 else str(n)


def _frac(rng: random.Random) -> str:
    a, b = rng.randint(1, 12), rng.randint(2, 19)
    form = rng.randrange(6)
    if form == 0:
        return f"\\frac{{{a}}}{{{b}}}"
    if form == 1:
        return f"\\frac{a % 10}{b % 10}"  # shorthand \frac12
    if form == 2:
        return f"\\dfrac{{{a}}}{{{b}}}"
    if form == 3:
        return f"-\\frac{{{a}}}{{{b}}}"
    if form == 4:
        return f"{a}/{b}"
    return f"\\frac{{\\sqrt{{{a}}}}}{{{b}}}"


def ground_truth(rng: random.Random) -> str:
    kind = rng.randrange(15)
    if kind <= 3:
        return _int(rng)
    if kind == 4:
        return f"{rng.randint(0, 99)}.{rng.randint(0, 99)}"
    if kind in (5, 6):
        return _frac(rng)
    if kind == 7:
        return rng.choice(("\\sqrt{2}", "2\\sqrt{3}", "\\sqrt3", "3\\sqrt{5}", "\\sqrt{13}", "4\\sqrt2"))
    if kind == 8:
        return rng.choice(("\\pi", "2\\pi", "\\frac{\\pi}{4}", "\\frac{3\\pi}{2}", "6\\pi"))
    if kind == 9:
        return f"{rng.randint(1, 359)}" + rng.choice(("^\\circ", "^{\\circ}", "", " degrees"))
    if kind == 10:
        return rng.choice(("(1, 2]", "[0,\\infty)", "(3,-4)", "(-\\infty, 5)", "\\{1,2,3\\}", "1, 2, 3", "2,3"))
    if kind == 11:
        return rng.choice(("x^2+1", "2x-3", "a=5", "y = 2x + 1", "x=4", "n^2", "\\frac{x}{2}", "3x"))
    if kind == 12:
        return rng.choice(("A", "(B)", "\\text{(C)}", "\\textbf{D}", "E", "\\text{yes}", "\\overline{AB}"))
    return rng.choice(("", "0", "[INVALID]", "\\$5", "5\\%", "10 \\text{ units}", "1 \\text{ and } 2",
                       "\\text{m}", "12 cm", "-0", "001", "1,000,000", "3.14", "1{,}000", "2,\\!500", "3\\mathrm{th}",
                       '"yes"', "\\text{Monday}", "4 \\text{and} 5", "1,\\text{and}2", "\\ldots", "5 \\text{ feet}"))


def _change_digit(s: str, rng: random.Random) -> str:
    spots = [i for i, c in enumerate(s) if c.isdigit()]
    if not spots:
        return s + str(rng.randint(0, 9))
    i = rng.choice(spots)
    return s[:i] + str((int(s[i]) + rng.randint(1, 9)) % 10) + s[i + 1:]


def _insert(s: str, piece: str, rng: random.Random) -> str:
    i = rng.randint(0, len(s))
    return s[:i] + piece + s[i:]


_MUTATIONS = (
    lambda s, r: s.replace(" ", "") if " " in s else _insert(s, " ", r),
    lambda s, r: f"${s}$",
    lambda s, r: f"\\boxed{{{s}}}",
    lambda s, r: r.choice(("\\text{", "\\textbf{", "\\overline{", "\\mbox{")) + s + "}",
    lambda s, r: s + r.choice(_UNITS),
    lambda s, r: s + r.choice((".", "!", " .", ".$", ",", ";", " ")),
    lambda s, r: r.choice(("x = ", "a=", "The answer is ", "n=", "$x=$ ", "an ", "a ")) + s,
    _change_digit,
    lambda s, r: s.replace("\\frac{", "\\frac", 1).replace("}{", "", 1) if "\\frac{" in s else s.replace(",", ""),
    lambda s, r: s.replace("\\dfrac", "\\frac").replace("\\frac", r.choice(("\\dfrac", "\\tfrac", "\\frac"))),
    lambda s, r: _insert(s, r.choice(_STRAY), r),
    lambda s, r: _insert(s, r.choice(_SNIPPETS), r),
    lambda s, r: s + r.choice(_SNIPPETS),
    lambda s, r: s.upper() if r.random() < 0.5 else s.lower(),
    lambda s, r: ground_truth(r),
    lambda s, r: f"{s}, {ground_truth(r)}",
)


def mutate(answer: str, rng: random.Random) -> str:
    """The predicted answer: the truth itself about a third of the time, else 1-3 random edits."""
    if rng.random() < 0.35:
        return answer
    for _ in range(rng.randint(1, 3)):
        answer = rng.choice(_MUTATIONS)(answer, rng)
    return answer


def _filler(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, max_words)))


def _answer_part(pred: str, rng: random.Random) -> str:
    kind = rng.randrange(16)
    return (
        f"Answer: {pred}", f"answer:{pred}", f"ANSWER :  {pred}", f"Final Answer: {pred}",
        f"**Answer:** {pred}", f"Answer:\n{pred}", f"The answer is {pred}", f"\\boxed{{{pred}}}",
        f"Answer: \\boxed{{{pred}}}", f"The final answer is $\\boxed{{{pred}}}$", f"Answer: {pred}.",
        f"Answer: {mutate(pred, rng)}\nAnswer: {pred}", f"Answer: {pred}\n\\boxed{{{mutate(pred, rng)}}}",
        f"\\boxed{{{pred}", f"\\boxed{{\\frac{{{pred}}}{{2}}}}", f"Answer:\t{pred}\r\n",
    )[kind]


def solution(pred: str, rng: random.Random) -> str:
    text = _filler(rng, 90) + rng.choice(("\n", " ", "\n\n", "", "\r\n")) + _answer_part(pred, rng)
    return text + rng.choice(("", "", "\n", " ", "\n\nI hope it is correct.", "\n" + _filler(rng, 30), "\t"))


def pause_tokens(rng: random.Random):
    u = rng.random()
    if u < 0.7:
        return None
    if u < 0.95:
        return [rng.randint(-400, 400) for _ in range(4)]
    return [rng.randint(0, 300) for _ in range(rng.choice((3, 5)))]  # malformed: both sides must raise


def cases(n: int, seed: int):
    """n seeded (solution, ground truth, pause_tokens_index, raw predicted answer) tuples."""
    rng = random.Random(seed)
    for _ in range(n):
        gt = ground_truth(rng)
        pred = mutate(gt, rng)
        yield solution(pred, rng), gt, pause_tokens(rng), pred


# ------------------------------------------------------------------------------------------------
# Comparison.


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # both sides raising counts as agreement
        return ("raised", type(e).__name__)


def _same(ours, theirs) -> bool:
    if isinstance(ours, tuple) and ours[:1] == ("raised",):
        return isinstance(theirs, tuple) and theirs[:1] == ("raised",)
    if isinstance(ours, dict) and isinstance(theirs, dict):
        # Equal values and the same types (acc is a bool on both sides; score a float).
        return ours == theirs and all(type(ours[k]) is type(theirs[k]) for k in ours)
    return ours == theirs


def compare(reference, n: int, seed: int = 0, show: int = 10) -> dict:
    """Scores `n` seeded inputs with ours and `reference`; returns counts and mismatch examples."""
    fallback = has_boxed_fallback(reference)
    stats = {mode: {"compared": 0, "mismatches": 0, "explained_by_boxed_fallback": 0, "both_raised": 0}
             for mode in ("minerva", "strict_box", "normalize")}
    coverage = {"score_+1_minerva": 0, "pred_invalid_minerva": 0, "box_found_strict": 0, "score_+1_strict": 0,
                "solutions_over_300_chars": 0, "pause_tokens_given": 0}
    distinct_preds: set = set()
    examples = []
    for sol, gt, pause, pred in cases(n, seed):
        coverage["solutions_over_300_chars"] += len(sol) > dapo.SOLUTION_TAIL_CHARS
        coverage["pause_tokens_given"] += pause is not None
        ours_strict = _call(dapo.compute_score, sol, gt, True, pause)
        runs = {
            "minerva": (_call(dapo.compute_score, sol, gt, False, pause),
                        _call(reference.compute_score, sol, gt, False, pause)),
            "strict_box": (ours_strict, _call(reference.compute_score, sol, gt, True, pause)),
            "normalize": (_call(dapo.normalize_final_answer, pred), _call(reference.normalize_final_answer, pred)),
        }
        for mode, (ours, theirs) in runs.items():
            s = stats[mode]
            s["compared"] += 1
            if _same(ours, theirs):
                s["both_raised"] += isinstance(ours, tuple)
                continue
            s["mismatches"] += 1
            # verl 0.9.1: no Answer: line -> the strict-box result on the same 300-character tail
            # (which raises, as strict-box mode does, on a malformed pause_tokens_index).
            box_used = not (isinstance(ours_strict, dict) and ours_strict["pred"] is None)
            if (fallback and mode == "minerva" and isinstance(ours, dict) and ours["pred"] == dapo.INVALID
                    and box_used and _same(ours_strict, theirs)):
                s["explained_by_boxed_fallback"] += 1
            elif len(examples) < show:
                examples.append({"mode": mode, "solution": sol, "ground_truth": gt, "pause_tokens_index": pause,
                                 "ours": ours, "verl": theirs})
        minerva = runs["minerva"][0]
        if isinstance(minerva, dict):
            coverage["score_+1_minerva"] += minerva["score"] == 1.0
            coverage["pred_invalid_minerva"] += minerva["pred"] == dapo.INVALID
            distinct_preds.add(minerva["pred"])
        if isinstance(ours_strict, dict):
            coverage["box_found_strict"] += ours_strict["pred"] is not None
            coverage["score_+1_strict"] += ours_strict["score"] == 1.0
    coverage["distinct_minerva_preds"] = len(distinct_preds)
    unexplained = sum(s["mismatches"] - s["explained_by_boxed_fallback"] for s in stats.values())
    return {"n": n, "seed": seed, "reference": {"source": reference.SOURCE, "sha256": reference.SHA256,
                                                "has_boxed_fallback": fallback},
            "modes": stats, "unexplained_mismatches": unexplained, "coverage": coverage, "examples": examples}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", default=None, help="verl wheel, directory or math_dapo.py (see above)")
    parser.add_argument("--n", type=int, default=400_000, help="random inputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=10, help="unexplained mismatches listed")
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    args = parser.parse_args(argv)
    try:
        reference = load_reference(args.verl)
    except ReferenceUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    start = time.perf_counter()
    res = compare(reference, args.n, args.seed, args.show)
    res["seconds"] = round(time.perf_counter() - start, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if res["unexplained_mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
