"""DAPO-Math rows: loading, validation, de-duplication and selection.

Schema (HF `BytedTsinghua-SIA/DAPO-Math-17k`, one row per problem)::

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=...)}],
     "ability": "MATH",
     "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "<uuid or int>", ...}}

`load_rows()` reads JSONL (one object per line) or Parquet (needs `pyarrow`); with no path it
reads the shipped `glm52_jax/assets/math_problems.jsonl` (75 hand-written integer-answer problems,
each with an `extra_info.check` arithmetic expression that the tests evaluate).

A top-level module importing only the standard library: the run (`rl.inputs`) and the evidence verifier
(`verify --data`, `evidence.data_check`) read rows with the same parser, and the verifier starts without JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["DAPO_PROMPT_PREFIX", "DAPO_PROMPT_SUFFIX", "DAPO_PROMPT_TEMPLATE", "EMBEDDED_PROBLEMS", "DapoFormatError",
           "DapoRow", "default_problems_path", "dapo_record", "dedupe_rows", "load_rows", "parse_row"]

DAPO_PROMPT_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
                      "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_PROMPT_SUFFIX = "\n\nRemember to put your answer on its own line after \"Answer:\"."
# The exact DAPO-Math-17k user-message wording; `{problem}` is the only placeholder.
DAPO_PROMPT_TEMPLATE = DAPO_PROMPT_PREFIX + "{problem}" + DAPO_PROMPT_SUFFIX


class DapoFormatError(ValueError):
    """A row does not follow the DAPO schema; the message names the row and the field."""


@dataclasses.dataclass(frozen=True)
class DapoRow:
    """One validated DAPO row.

    index: 0-based position of the row in its source file (before de-duplication/selection).
    prompt: the chat messages, each a {"role", "content"} dict (DAPO rows have one user message).
    uid: `extra_info["index"]` (a uuid string in DAPO-Math-17k, an int in our shipped set), or None.
    """

    index: int
    prompt: tuple[dict[str, str], ...]
    ground_truth: str
    data_source: str
    ability: str | None = None
    reward_style: str | None = None
    uid: str | int | None = None
    extra_info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.prompt]

    @property
    def content(self) -> str:
        """Content of the last user message (the DAPO-worded question)."""
        for m in reversed(self.prompt):
            if m["role"] == "user":
                return m["content"]
        raise ValueError(f"row {self.index} has no user message")

    @property
    def problem(self) -> str:
        """The bare problem: the user content with the DAPO wording stripped when present."""
        c = self.content
        if c.startswith(DAPO_PROMPT_PREFIX) and c.endswith(DAPO_PROMPT_SUFFIX):
            return c[len(DAPO_PROMPT_PREFIX):len(c) - len(DAPO_PROMPT_SUFFIX)]
        return c

    def dedupe_key(self) -> tuple[tuple[str, str], ...]:
        return tuple((m["role"], m["content"]) for m in self.prompt)


# How a receipt names the shipped problems (the package-relative path; where the package lives differs per install).
EMBEDDED_PROBLEMS = "glm52_jax/assets/math_problems.jsonl"


def default_problems_path() -> Path:
    return Path(os.fspath(resources.files("glm52_jax").joinpath("assets", "math_problems.jsonl")))


def dapo_record(problem: str, ground_truth: str | int, index: int | str, *, style: str = "rule-lm",
                **extra: Any) -> dict[str, Any]:
    """A raw DAPO-schema dict for `problem` (the inverse of `parse_row`)."""
    return {"data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(ground_truth), "style": style},
            "extra_info": {"index": index, **extra}}


def _type_name(v: Any) -> str:
    return type(v).__name__


def parse_row(raw: Any, index: int, *, where: str = "") -> DapoRow:
    """Validate one raw row (a dict) and return a DapoRow; DapoFormatError names row and field."""
    loc = f"row {index}{where}"

    def fail(field: str, problem: str):
        raise DapoFormatError(f"{loc}: field {field!r} {problem}")

    if not isinstance(raw, Mapping):
        raise DapoFormatError(f"{loc}: expected an object, got {_type_name(raw)}")
    for key in ("data_source", "prompt", "reward_model"):
        if key not in raw or raw[key] is None:
            fail(key, "is missing")
    data_source = raw["data_source"]
    if not isinstance(data_source, str):
        fail("data_source", f"must be a str, got {_type_name(data_source)}")

    prompt = raw["prompt"]
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) and not _is_array(prompt):
        fail("prompt", f"must be a list of chat messages, got {_type_name(prompt)}")
    prompt = list(prompt)
    if not prompt:
        fail("prompt", "is an empty list")
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, Mapping):
            fail(f"prompt[{j}]", f"must be an object with 'role' and 'content', got {_type_name(m)}")
        for k in ("role", "content"):
            if k not in m or m[k] is None:
                fail(f"prompt[{j}].{k}", "is missing")
            if not isinstance(m[k], str):
                fail(f"prompt[{j}].{k}", f"must be a str, got {_type_name(m[k])}")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in messages):
        fail("prompt", "has no message with role 'user'")

    rm = raw["reward_model"]
    if not isinstance(rm, Mapping):
        fail("reward_model", f"must be an object, got {_type_name(rm)}")
    if rm.get("ground_truth") is None:
        fail("reward_model.ground_truth", "is missing")
    gt = rm["ground_truth"]
    if not isinstance(gt, str):
        fail("reward_model.ground_truth", f"must be a str, got {_type_name(gt)}")
    style = rm.get("style")
    if style is not None and not isinstance(style, str):
        fail("reward_model.style", f"must be a str, got {_type_name(style)}")

    ability = raw.get("ability")
    if ability is not None and not isinstance(ability, str):
        fail("ability", f"must be a str, got {_type_name(ability)}")
    extra = raw.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        fail("extra_info", f"must be an object, got {_type_name(extra)}")
    uid = extra.get("index")
    if uid is not None and (isinstance(uid, bool) or not isinstance(uid, (str, int))):
        fail("extra_info.index", f"must be a str or int, got {_type_name(uid)}")
    return DapoRow(index=index, prompt=tuple(messages), ground_truth=gt, data_source=data_source, ability=ability,
                   reward_style=style, uid=uid, extra_info=dict(extra))


def _is_array(x: Any) -> bool:  # numpy arrays (e.g. from pandas-produced parquet readers)
    return hasattr(x, "__array__") and hasattr(x, "__len__")


def _read_jsonl(path: Path) -> Iterable[tuple[Any, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line), f" ({path.name} line {lineno})"
            except json.JSONDecodeError as e:
                raise DapoFormatError(f"{path.name} line {lineno}: invalid JSON: {e}") from None


def _read_parquet(path: Path) -> Iterable[tuple[Any, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow") from None
    table = pq.read_table(path)
    for batch in table.to_batches():
        for raw in batch.to_pylist():
            yield raw, ""


def dedupe_rows(rows: Iterable[DapoRow]) -> list[DapoRow]:
    """`rows` without those whose prompt messages equal an earlier row's (the first occurrence kept)."""
    seen: set = set()
    unique = []
    for row in rows:
        key = row.dedupe_key()
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def load_rows(path: str | os.PathLike | None = None, *, dedupe: bool = False,
              select: int | Sequence[int] | None = None) -> list[DapoRow]:
    """Load and validate DAPO rows.

    path: a `.jsonl` file (or `.parquet` with pyarrow installed); None = the shipped problems.
    dedupe: drop rows whose prompt messages equal an earlier row's (keeps the first occurrence;
      DAPO-Math-17k's parquet repeats each prompt ~100x).
    select: an int or a sequence of ints: positions in the loaded (de-duplicated, if asked) list,
      returned in the order given; IndexError if out of range. Each row keeps its file position
      in `DapoRow.index`.
    """
    path = default_problems_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no DAPO data file at {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        raw_rows = _read_parquet(path)
    elif suffix in (".jsonl", ".ndjson"):
        raw_rows = _read_jsonl(path)
    else:
        raise ValueError(f"unsupported DAPO data file {path}: expected .jsonl or .parquet")
    rows = [parse_row(raw, i, where=where) for i, (raw, where) in enumerate(raw_rows)]
    if dedupe:
        rows = dedupe_rows(rows)
    if select is None:
        return rows
    single = isinstance(select, int) and not isinstance(select, bool)
    picks = [select] if single else list(select)
    for p in picks:
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"select must hold ints, got {p!r}")
        if not 0 <= p < len(rows):
            raise IndexError(f"select index {p} out of range: {len(rows)} rows loaded from {path}"
                             + (" after de-duplication" if dedupe else ""))
    return [rows[p] for p in picks]
