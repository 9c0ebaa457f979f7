"""`python -m glm52_jax.launch --helpconfig`: every config key with its value and meaning.

The meanings are the comments of `run_defaults.get_config()`, read from its source so the help cannot
drift from the defaults: a key's comment is the one on its line, or the comment lines right above it
(both, joined, when it has both). A section's comment (`c.parity = ConfigDict()  # ...`) heads its keys.
Imports no JAX.
"""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glm52_jax.run_config import flatten

DEFAULTS_SOURCE = Path(__file__).with_name("run_defaults.py")
_FUNCTION = "get_config"
_WIDTH = 110


def _comments_by_line(source: str) -> dict[int, str]:
    """{line number: comment text without '#'} of every comment in `source`."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


def _dotted(target: ast.expr) -> str | None:
    """`c.a.b` -> "a.b" (None for any other assignment target)."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    return ".".join(reversed(parts)) if isinstance(target, ast.Name) and parts else None


def key_comments(source: str | None = None) -> dict[str, str]:
    """{"train.steps": "transactions; ...", "parity": "--mode=parity: ...", ...} for every `c.<key> = ...`
    of get_config() in `source` (default: run_defaults.py), in source order."""
    source = DEFAULTS_SOURCE.read_text(encoding="utf-8") if source is None else source
    comments = _comments_by_line(source)
    lines = source.splitlines()
    function = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == _FUNCTION)
    found: dict[str, str] = {}
    for statement in function.body:
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
            continue
        key = _dotted(statement.targets[0])
        if key is None:
            continue
        above, line = [], statement.lineno - 1
        while line >= 1 and line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        own = [comments[statement.lineno]] if statement.lineno in comments else []
        found[key] = " ".join(above + own)
    return found


def format_help(config: Mapping[str, Any], defaults: Mapping[str, Any], comments: Mapping[str, str]) -> str:
    """The listing, in run_defaults.py's order: per section its comment, then each key as `key = value` (plus
    `(default X)` where the loaded config changes it) and its meaning, wrapped, below it."""
    values, default_values = flatten(config), flatten(defaults)
    order = [k for k in comments if k in values] + [k for k in values if k not in comments]
    out = ["Config keys: set any with --config.<key>=<value>. Values of the loaded config (--config=FILE); defaults",
           "and meanings from glm52_jax/run_defaults.py."]
    section = None
    for key in order:
        head = key.rpartition(".")[0]
        if head != section:
            section = head
            out.append("")
            if head:
                out.append(f"[{head}]" + (f"  {comments[head]}" if comments.get(head) else ""))
        value = values[key]
        changed = "" if value == default_values.get(key) else f"  (default {default_values.get(key)!r})"
        out.append(f"{key} = {value!r}{changed}")
        meaning = comments.get(key) or "(no comment in run_defaults.py)"
        out += textwrap.wrap(meaning, width=_WIDTH, initial_indent="    ", subsequent_indent="    ",
                             break_on_hyphens=False, break_long_words=False)
    return "\n".join(out)
