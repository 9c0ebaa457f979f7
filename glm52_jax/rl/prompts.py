"""Exact-N-token prompts: deterministic filler + the chat-formatted DAPO question at the end.

Layout (ids; the tokenizer's chat template: the checkpoint's own jinja template when it ships one,
else the GLM-4.5-style fallback of `glm52_jax.rollout.tokenizer`, whose texts are shown)::

    head     = encode("[gMASK]<sop>" + <earlier turns, e.g. system> + "<|user|>\\n")
    filler   = the seed's filler block ids, repeated cyclically and cut to exactly F ids
    question = encode("\\n\\n" + <last user message content> + "<|assistant|>")
    prompt   = head + filler + question,   F = N - len(head) - len(question)

With a jinja template, head and the question's tail are the texts the template renders before and
after the user content (`JinjaChatTemplate.prompt_parts`): found by rendering the conversation with a
marker where the filler goes, so thinking tags, role tokens etc. are exactly the template's.

The filler sits *inside* the single user turn, before the problem, so the whole prompt is one valid
chat turn: `[gMASK]<sop><|user|>\\n<filler...>\\n\\n<DAPO question><|assistant|>`.

The prompt is defined at the id level. Filler lines are encoded one by one and concatenated (each
line ends in a newline, so with the shipped tokenizer this equals encoding the joined text), and
the block is cut at an arbitrary id, so a prompt may end its filler mid-word. Decoding a prompt and
re-encoding the text is *not* guaranteed to give the same ids; never round-trip prompts through
text. Because the filler depends only on (tokenizer, seed), `filler[:F]` is a prefix of
`filler[:F']` for F <= F': for one N, two rows' prompts share at least
`N - max(len(question_a), len(question_b))` leading ids (their head + the shorter filler), which is
what a prefix cache reuses across candidate rows. The filler block is encoded once per
(tokenizer, seed) and tiled with numpy, so N = 2,097,152 costs milliseconds.
"""

from __future__ import annotations

import dataclasses
import random
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from glm52_jax.dapo_data import DapoRow
from glm52_jax.rollout.tokenizer import ChatFormat, Tokenizer

__all__ = ["ExactPrompt", "QUESTION_SEPARATOR", "build_exact_prompt", "filler_block", "filler_lines",
           "layout_exact_prompt", "min_prompt_tokens"]

QUESTION_SEPARATOR = "\n\n"  # between the filler and the question (always present, also when F = 0)
FILLER_LINES = 128

_HEADER = "The following lines are padding text; they are not part of the problem.\n"
_SUBJECTS = ("A grey heron", "The night train", "An old lighthouse", "The orchard", "A paper kite", "The harbor",
             "A sleepy cat", "The mountain road", "A wooden bridge", "The evening wind", "A brass compass",
             "The stone wall")
_VERBS = ("rests near", "looks over", "drifts past", "waits beside", "circles above", "leans toward",
          "glows behind", "hums along")
_PLACES = ("the quiet river", "the empty field", "the sleeping town", "the northern hills", "the misty lake",
           "the narrow valley", "the open sea", "the old market")
_TAILS = ("as the day ends.", "under a pale sky.", "long after sunset.", "in the cold morning.",
          "while the lanterns dim.", "before the rain returns.")

_BLOCK_CACHE: weakref.WeakKeyDictionary[Tokenizer, dict[int, np.ndarray]] = weakref.WeakKeyDictionary()


def filler_lines(seed: int = 0, n_lines: int = FILLER_LINES) -> list[str]:
    """The filler text of `seed`: a header line then `n_lines - 1` generated sentences, each ending in '\\n'."""
    rng = random.Random(seed)
    lines = [_HEADER]
    for _ in range(n_lines - 1):
        lines.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_PLACES)} {rng.choice(_TAILS)}\n")
    return lines


def filler_block(tokenizer: Tokenizer, seed: int = 0) -> np.ndarray:
    """Ids of one filler block (lines encoded separately, concatenated); cached per (tokenizer, seed).
    The returned array is read-only."""
    per_tok = _BLOCK_CACHE.setdefault(tokenizer, {})
    block = per_tok.get(seed)
    if block is None:
        ids = [i for line in filler_lines(seed) for i in tokenizer.encode(line)]
        block = np.asarray(ids, dtype=np.int64)
        block.setflags(write=False)
        per_tok[seed] = block
    return block


@dataclasses.dataclass(frozen=True)
class ExactPrompt:
    """An exact-N prompt and its segment lengths (head + filler + question = len(ids))."""

    ids: list[int]
    n_head: int
    n_filler: int
    n_question: int

    @property
    def question_start(self) -> int:
        """Index of the first question id (= n_head + n_filler): ids before it depend only on the
        tokenizer, template, earlier turns, seed and F."""
        return self.n_head + self.n_filler


def _messages(row_or_messages) -> list[Mapping[str, str]]:
    if isinstance(row_or_messages, DapoRow):
        return row_or_messages.messages
    if isinstance(row_or_messages, str):
        return [{"role": "user", "content": row_or_messages}]
    if isinstance(row_or_messages, Sequence) and row_or_messages:
        return list(row_or_messages)
    raise TypeError("expected a DapoRow, a non-empty list of chat messages, or a user-message string; "
                    f"got {type(row_or_messages).__name__}")


def _segments(tokenizer: Tokenizer, row_or_messages, template: ChatFormat | None) -> tuple[list[int], list[int]]:
    """(head ids, question ids): the template's text before the question turn's content, and the
    separator + question + the template's text after it (generation prompt included)."""
    template = template or tokenizer.chat_template
    messages = _messages(row_or_messages)
    last = messages[-1]
    if not isinstance(last, Mapping) or last.get("role") != "user" or not isinstance(last.get("content"), str):
        raise ValueError("the last message must be a user message with str content (the question)")
    question = QUESTION_SEPARATOR + last["content"]
    # The filler goes at the start of the user content, before the separator: the template must keep
    # `filler + question` verbatim inside the turn, which `prompt_parts` checks for a jinja template.
    head, tail = template.prompt_parts([*messages[:-1], {**last, "content": question}])
    return tokenizer.encode(head), tokenizer.encode(question + tail)


def min_prompt_tokens(tokenizer: Tokenizer, row_or_messages, *, template: ChatFormat | None = None) -> int:
    """The smallest N `build_exact_prompt` accepts for this question (no filler)."""
    head, question = _segments(tokenizer, row_or_messages, template)
    return len(head) + len(question)


def layout_exact_prompt(tokenizer: Tokenizer, row_or_messages, n_tokens: int, *, filler_seed: int = 0,
                        template: ChatFormat | None = None) -> ExactPrompt:
    """`build_exact_prompt` plus the segment lengths."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)):
        raise TypeError(f"n_tokens must be an int, got {type(n_tokens).__name__}")
    n_tokens = int(n_tokens)
    head, question = _segments(tokenizer, row_or_messages, template)
    minimum = len(head) + len(question)
    if n_tokens < minimum:
        raise ValueError(f"n_tokens={n_tokens} is too small for this question: the minimum N is {minimum} "
                         f"({len(head)} head ids + {len(question)} question ids, no filler)")
    n_filler = n_tokens - minimum
    filler = np.resize(filler_block(tokenizer, filler_seed), n_filler)
    ids = np.concatenate([np.asarray(head, np.int64), filler, np.asarray(question, np.int64)]).tolist()
    return ExactPrompt(ids=ids, n_head=len(head), n_filler=n_filler, n_question=len(question))


def build_exact_prompt(tokenizer: Tokenizer, row_or_messages: DapoRow | Sequence[Mapping[str, str]] | str,
                       n_tokens: int, *, filler_seed: int = 0, template: ChatFormat | None = None) -> list[int]:
    """Exactly `n_tokens` prompt ids: head + deterministic filler + chat-formatted question (module doc).

    row_or_messages: a DapoRow, chat messages whose last one is the user question (earlier ones,
    e.g. a system message, go before the filler), or a user-message string.
    Raises ValueError (naming the minimum N) when `n_tokens` cannot hold the question.
    """
    return layout_exact_prompt(tokenizer, row_or_messages, n_tokens, filler_seed=filler_seed, template=template).ids
