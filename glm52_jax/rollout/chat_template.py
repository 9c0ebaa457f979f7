"""A checkpoint's own chat template (jinja), rendered the way transformers' `apply_chat_template` renders it.

Where it comes from (HF's rule): `DIR/chat_template.jinja`, else `DIR/tokenizer_config.json`'s
`chat_template`, which is either the template string or a list of `{"name", "template"}` of which the
one named "default" is used. `find_chat_template(DIR)` returns None when DIR ships neither; the run
then falls back to the hand-written `rollout.tokenizer.ChatTemplate` layout.

How it renders (facts read from transformers 5.24 `utils/chat_template_utils.py` and
`tokenization_utils_base.py`, reimplemented here):

* a sandboxed, immutable jinja environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
  extension (`{% break %}` / `{% continue %}`) and a `{% generation %}...{% endgeneration %}` block tag
  that renders its body unchanged (HF uses it only to mark assistant tokens);
* `tojson` is `json.dumps` (no HTML escaping, `ensure_ascii=False`), `raise_exception(msg)` raises a
  template error, `strftime_now(fmt)` is the local time, `dict(...)` builds a dict, and `namespace(...)`
  refuses underscore-prefixed attribute names;
* variables: `messages` (copies with None-valued keys dropped; a message's reasoning under
  `reasoning_content` / `thinking` / `reasoning` is visible under both `thinking` and `reasoning_content`),
  `tools=None`, `documents=None`, `add_generation_prompt`, the named special tokens of
  tokenizer_config.json (`bos_token`, `eos_token`, ...), and any extra keyword (e.g. `enable_thinking`),
  which overrides a special token of the same name.

Rendered text is encoded as plain text (`Tokenizer.encode`, no tokens added), as
`apply_chat_template(..., tokenize=True)` does.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from glm52_jax.evidence.hashing import sha256_bytes
from glm52_jax.json_files import read_json

__all__ = ["ChatTemplateError", "JinjaChatTemplate", "SPECIAL_TOKEN_NAMES", "TEMPLATE_FILE", "TOKENIZER_CONFIG",
           "find_chat_template"]

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The named special tokens HF passes to every template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Stands for the filler at the start of the last user message while the template renders (`prompt_parts`).
_MARKER = "<<glm52-jax:user-content-starts-here>>"


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or rendered; a one-line message naming its file."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}` renders `body` unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()` minus underscore-prefixed attributes (they could reach Python internals)."""

    def __init__(*args, **kwargs):  # noqa: B902 - jinja's own signature, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _DictBuilder:
    """The template's `dict(...)`: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictBuilder(),
                       namespace=_Namespace)
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: dict copies without None values, reasoning under both names."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@dataclasses.dataclass(frozen=True)
class JinjaChatTemplate:
    """A jinja chat template plus the special tokens it may reference (module docstring).

    source: the template text; origin: where it was read from (errors and receipts name it);
    special_tokens: `{"bos_token": "[gMASK]", ...}` from tokenizer_config.json (may be empty).
    """

    source: str
    origin: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    _compiled: jinja2.Template = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.source, str):
            raise ChatTemplateError(f"{self.origin}: the chat template must be a string, "
                                    f"got {type(self.source).__name__}")
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{self.origin}: chat template syntax error at line {e.lineno}: "
                                    f"{_one_line(e.message)}") from None
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "special_tokens", dict(self.special_tokens))

    @property
    def sha256(self) -> str:
        """sha256 of the template text (UTF-8); for a chat_template.jinja file, that of the file."""
        return sha256_bytes(self.source.encode("utf-8"))

    def describe(self) -> dict[str, str]:
        """Which template this is, for receipts."""
        return {"template": self.origin, "sha256": self.sha256}

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **variables) -> str:
        """The prompt text for `messages`, as `apply_chat_template(messages, tokenize=False, ...)` renders it."""
        context = {**self.special_tokens, **variables}
        try:
            return self._compiled.render(messages=_template_messages(messages), tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...), undefined calls, sandbox refusals
            raise ChatTemplateError(f"{self.origin}: chat template error: {_one_line(e)}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"{self.origin}: chat template error: {type(e).__name__}: {_one_line(e)}") \
                from None

    def prompt_parts(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
        """(head, tail): the text before and after the last message's content when `messages` are rendered
        with a generation prompt, so that `render` of them with any text T put before that content is
        `head + T + content + tail`. Raises ChatTemplateError when the template does not place that
        content verbatim exactly once (an exact-N prompt puts its filler there at the id level)."""
        if not messages:
            raise ValueError("prompt_parts needs at least one message")
        *earlier, last = _template_messages(messages)
        content = last.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message {len(messages) - 1}: 'content' must be a str, got {type(content).__name__}")
        text = self.render([*earlier, {**last, "content": _MARKER + content}], add_generation_prompt=True)
        if text.count(_MARKER) != 1:
            raise ChatTemplateError(f"{self.origin}: the chat template renders the last message's content "
                                    f"{text.count(_MARKER)} times; exact-N prompts need it exactly once")
        head, rest = text.split(_MARKER)
        if not rest.startswith(content):
            raise ChatTemplateError(f"{self.origin}: the chat template changes the last message's content "
                                    "(exact-N prompts need it verbatim)")
        return head, rest[len(content):]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with "content"."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_chat_template(directory: str | os.PathLike) -> JinjaChatTemplate | None:
    """The chat template `directory` ships (module docstring), or None. Errors name the file."""
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG
    config = read_json(config_path, "tokenizer config") if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    jinja_path = directory / TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            source = jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ChatTemplateError(f"{jinja_path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        return JinjaChatTemplate(source, origin=str(jinja_path), special_tokens=special)
    source = config.get("chat_template")
    if source is None:
        return None
    origin = f"{config_path} (chat_template)"
    if isinstance(source, list):  # HF's named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        if "default" not in named:
            raise ChatTemplateError(f"{origin}: a list of named templates without a 'default' one "
                                    f"(names: {sorted(map(str, named))})")
        source, origin = named["default"], f"{config_path} (chat_template 'default')"
    return JinjaChatTemplate(source, origin=origin, special_tokens=special)
