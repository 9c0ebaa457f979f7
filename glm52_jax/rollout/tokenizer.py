"""Tokenizer wrapper (HF `tokenizer.json` via the `tokenizers` library) and GLM chat formatting.

Chat template (what `ChatTemplate()` renders, GLM-4.5/4.6 convention):

    [gMASK]<sop><|system|>\\n{system}<|user|>\\n{user}<|assistant|>\\n{assistant}...<|assistant|>

* `[gMASK]<sop>` once at the very start; every turn is a role token followed by a newline and the
  content; turns are not terminated (the next role token ends a turn); the generation prompt is a
  bare `<|assistant|>`. This is the GLM-4.5 / GLM-4.6 `chat_template.jinja` layout with thinking
  left to the model (third-party renderers agree, e.g. ollama's GLM-4.6 renderer renders
  `[gMASK]<sop><|user|>\\nHello<|assistant|>`).
* GLM-4.7 / GLM-5.x templates drop the newline after the role tokens and open the assistant turn
  with `<think>` (thinking) or an empty/closed think block (non-thinking), per third-party
  renderers; `ChatTemplate.glm5()` gives that layout with `<|assistant|><think>` as the generation
  prompt. We could not read the official GLM-5.2 `chat_template.jinja`, so treat that preset as
  unverified. The project's tiny tokenizer has no `<think>` special token, so `glm5()` there
  encodes `<think>` as ordinary bytes; with a real GLM tokenizer it is one id.

Special tokens are added tokens of the HF tokenizer: any occurrence of their text in an encoded
string (template *or* message content) maps to the single special id, exactly as HF
`apply_chat_template(..., tokenize=True)` does. `encode` never adds tokens implicitly.

`ChatTemplate` is the fallback for checkpoints that ship no chat template of their own; a shipped
one is a `rollout.chat_template.JinjaChatTemplate`. Both implement `ChatFormat`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Protocol

import tokenizers

from glm52_jax.evidence.hashing import sha256_bytes

__all__ = ["ChatFormat", "ChatTemplate", "GLM_EOS_TOKENS", "SPECIAL_TOKENS", "Tokenizer", "default_tokenizer_path"]

# The shipped tiny tokenizer's special tokens, in id order (ids 0..6). Chosen so that id 0 is the
# first token of every prompt ("bos" = [gMASK]) and id 1 is <|endoftext|>, matching
# `glm52_jax.config.tiny()` (bos_token_id=0, eos_token_id=(1,)).
SPECIAL_TOKENS: tuple[str, ...] = ("[gMASK]", "<|endoftext|>", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                   "<|pad|>")

# GLM generation stops on any of these (GLM-4.5/5.x generation_config: <|endoftext|>, <|user|>,
# <|observation|>); tokens a vocabulary lacks are skipped.
GLM_EOS_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")

_CONTENT = "{content}"


def default_tokenizer_path() -> Path:
    """The shipped tiny tokenizer: `glm52_jax/assets/tokenizer.json`."""
    return Path(os.fspath(resources.files("glm52_jax").joinpath("assets", "tokenizer.json")))


class ChatFormat(Protocol):
    """What renders chat messages into prompt text (`ChatTemplate`, `chat_template.JinjaChatTemplate`)."""

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (list of {"role", "content"})."""

    def prompt_parts(self, messages: Sequence[Mapping[str, str]]) -> tuple[str, str]:
        """(head, tail) around the last message's content in `render(messages)`, generation prompt in tail;
        text put at the start of that content lands between head and content."""

    def describe(self) -> dict[str, str]:
        """{"template": which one, "sha256": of its definition}, for receipts."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A GLM-style chat layout. Each turn string holds `{content}` exactly once (literal replace,
    so braces in content are safe). Defaults are the GLM-4.5/4.6 convention (module docstring)."""

    prefix: str = "[gMASK]<sop>"
    system: str = "<|system|>\n{content}"
    user: str = "<|user|>\n{content}"
    assistant: str = "<|assistant|>\n{content}"
    generation_prompt: str = "<|assistant|>"

    def __post_init__(self):
        for role in ("system", "user", "assistant"):
            turn = getattr(self, role)
            if not isinstance(turn, str) or turn.count(_CONTENT) != 1:
                raise ValueError(f"ChatTemplate.{role} must contain '{_CONTENT}' exactly once, got {turn!r}")
        for name in ("prefix", "generation_prompt"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"ChatTemplate.{name} must be a str")

    @classmethod
    def glm5(cls, *, thinking: bool = True) -> ChatTemplate:
        """GLM-4.7/GLM-5.x layout (no newline after role tokens). Generation prompt
        `<|assistant|><think>` when `thinking`, else `<|assistant|></think>` [unverified]."""
        return cls(system="<|system|>{content}", user="<|user|>{content}", assistant="<|assistant|>{content}",
                   generation_prompt="<|assistant|><think>" if thinking else "<|assistant|></think>")

    def turn_parts(self, role: str) -> tuple[str, str]:
        """(text before content, text after content) of one turn of `role`."""
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"unknown chat role {role!r} (expected system, user or assistant)")
        before, after = getattr(self, role).split(_CONTENT)
        return before, after

    def render_turn(self, role: str, content: str) -> str:
        before, after = self.turn_parts(role)
        return before + content + after

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
               include_prefix: bool = True) -> str:
        """The prompt text for `messages` (list of {"role", "content"})."""
        parts = [self.prefix] if include_prefix else []
        for i, message in enumerate(messages):
            role, content = _message_fields(message, i)
            parts.append(self.render_turn(role, content))
        if add_generation_prompt:
            parts.append(self.generation_prompt)
        return "".join(parts)

    def prompt_parts(self, messages: Sequence[Mapping[str, str]]) -> tuple[str, str]:
        """(head, tail) around the last message's content in `render(messages)` (`ChatFormat`)."""
        if not messages:
            raise ValueError("prompt_parts needs at least one message")
        *earlier, last = messages
        role, _ = _message_fields(last, len(earlier))
        before, after = self.turn_parts(role)
        return self.render(earlier, add_generation_prompt=False) + before, after + self.generation_prompt

    def describe(self) -> dict[str, str]:
        """The hand-written layout and the sha256 of its fields (canonical JSON), for receipts."""
        fields = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return {"template": "builtin:ChatTemplate", "sha256": sha256_bytes(fields.encode("utf-8"))}


def _message_fields(message, i: int) -> tuple[str, str]:
    if not isinstance(message, Mapping):
        raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise ValueError(f"message {i}: 'role' must be a str, got {role!r}")
    if not isinstance(content, str):
        raise ValueError(f"message {i} ({role}): 'content' must be a str, got {type(content).__name__}")
    return role, content


class Tokenizer:
    """A `tokenizers.Tokenizer` plus GLM chat formatting.

    `Tokenizer(path)` loads an HF `tokenizer.json` (or a directory holding one);
    `Tokenizer.default()` loads the shipped 512-token byte-level BPE.
    """

    def __init__(self, source: str | os.PathLike | tokenizers.Tokenizer, *,
                 chat_template: ChatFormat | None = None, eos_tokens: Iterable[str] = GLM_EOS_TOKENS):
        if isinstance(source, tokenizers.Tokenizer):
            self._tok, self.path = source, None
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer.json at {path}")
            self._tok, self.path = tokenizers.Tokenizer.from_file(str(path)), path
        self.chat_template = chat_template if chat_template is not None else ChatTemplate()
        self._special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.eos_ids: tuple[int, ...] = tuple(self._special[t] for t in eos_tokens if t in self._special)
        if not self.eos_ids:
            raise ValueError(f"none of the eos tokens {tuple(eos_tokens)} is a special token of this tokenizer")

    @classmethod
    def default(cls, **kwargs) -> Tokenizer:
        return cls(default_tokenizer_path(), **kwargs)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids (base vocabulary + added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    @property
    def pad_id(self) -> int | None:
        for name in ("<|pad|>", "<|endoftext|>"):
            if name in self._special:
                return self._special[name]
        return None

    def token_id(self, token: str) -> int:
        """The single id of a special (or any whole) token; KeyError if it is not one token."""
        if token in self._special:
            return self._special[token]
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"{token!r} is not a single token of this tokenizer")
        return tid

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added (special-token text maps to its id)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    template: ChatFormat | None = None) -> str:
        return (template or self.chat_template).render(messages, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                            template: ChatFormat | None = None) -> list[int]:
        """Token ids of the chat-formatted `messages` (= encode(render_chat(...)))."""
        return self.encode(self.render_chat(messages, add_generation_prompt, template))

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids})"
