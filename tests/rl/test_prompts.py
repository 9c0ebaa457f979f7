"""Exact-N prompts: exact length for every N, shared filler prefix across rows, 2M-token speed."""

import time

import numpy as np
import pytest

from glm52_jax.dapo_data import load_rows
from glm52_jax.rl.prompts import (
    QUESTION_SEPARATOR,
    build_exact_prompt,
    filler_block,
    filler_lines,
    layout_exact_prompt,
    min_prompt_tokens,
)
from glm52_jax.rollout.tokenizer import ChatTemplate, Tokenizer

GMASK, SOP, SYSTEM, USER, ASSISTANT = 0, 2, 3, 4, 5


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


@pytest.fixture(scope="module")
def rows():
    return load_rows()


def test_layout_and_question_at_end(tok, rows):
    row = rows[0]
    p = layout_exact_prompt(tok, row, 700)
    assert len(p.ids) == 700 == p.n_head + p.n_filler + p.n_question
    assert p.ids[:p.n_head] == [GMASK, SOP, USER] + tok.encode("\n")
    question = tok.encode(QUESTION_SEPARATOR + row.content + "<|assistant|>")
    assert p.ids[p.question_start:] == question and p.ids[-1] == ASSISTANT
    block = filler_block(tok, 0).tolist()
    assert p.ids[p.n_head:p.question_start] == block[:p.n_filler]
    # exactly one user turn and one generation prompt: no role token inside filler or question
    assert [i for i in p.ids if i < 7] == [GMASK, SOP, USER, ASSISTANT]


def test_whole_block_prompt_is_a_single_valid_user_turn(tok, rows):
    """With F = one whole filler block the prompt decodes to the chat template of one user message."""
    row = rows[5]
    block_text = "".join(filler_lines(0))
    n = min_prompt_tokens(tok, row) + len(filler_block(tok, 0))
    text = tok.decode(build_exact_prompt(tok, row, n))
    assert text == ChatTemplate().render([{"role": "user", "content": block_text + "\n\n" + row.content}])
    assert text.startswith("[gMASK]<sop><|user|>\nThe following lines are padding text")


def test_filler_block_is_boundary_stable(tok):
    for seed in (0, 1, 7):
        lines = filler_lines(seed)
        block = filler_block(tok, seed)
        assert block.tolist() == tok.encode("".join(lines))  # per-line encoding == whole-text encoding
        assert all(line.endswith("\n") for line in lines) and len(lines) == 128
        assert len(block) > 2000
        assert not block.flags.writeable
    assert filler_block(tok, 0) is filler_block(tok, 0)  # cached
    assert filler_lines(0) == filler_lines(0) and filler_lines(0) != filler_lines(1)


def test_every_n_from_minimum_is_exact(tok, rows):
    for row in (rows[0], rows[42], rows[-1]):
        m = min_prompt_tokens(tok, row)
        for n in range(m, m + 301):
            ids = build_exact_prompt(tok, row, n)
            assert len(ids) == n
        assert build_exact_prompt(tok, row, m) == \
            tok.encode("[gMASK]<sop><|user|>\n") + tok.encode(QUESTION_SEPARATOR + row.content + "<|assistant|>")


@pytest.mark.parametrize("n", [1000, 4096, 4097, 10_000, 65_535, 65_536, 65_537, 131_072])
def test_large_n_exact(tok, rows, n):
    for row in rows[:5]:
        p = layout_exact_prompt(tok, row, n)
        assert len(p.ids) == n and p.ids[-1] == ASSISTANT and p.ids[:3] == [GMASK, SOP, USER]
        assert p.n_filler == n - min_prompt_tokens(tok, row)


def test_too_small_n_names_the_minimum(tok, rows):
    row = rows[3]
    m = min_prompt_tokens(tok, row)
    assert m > 100
    for n in (m - 1, 10, 0):
        with pytest.raises(ValueError, match=rf"n_tokens={n} is too small .* minimum N is {m}\b"):
            build_exact_prompt(tok, row, n)
    with pytest.raises(TypeError):
        build_exact_prompt(tok, row, 1000.0)


def _common_prefix(a, b):
    a, b = np.asarray(a), np.asarray(b)
    k = min(len(a), len(b))
    diff = np.nonzero(a[:k] != b[:k])[0]
    return int(diff[0]) if len(diff) else k


@pytest.mark.parametrize("n", [600, 4096, 100_000])
def test_rows_share_the_filler_prefix(tok, rows, n):
    """For one N, any two rows' prompts agree up to where the longer question starts."""
    longest_q = max(len(tok.encode(QUESTION_SEPARATOR + r.content + "<|assistant|>")) for r in rows)
    base = build_exact_prompt(tok, rows[0], n)
    nq0 = layout_exact_prompt(tok, rows[0], n).n_question
    for row in rows[1:]:
        p = layout_exact_prompt(tok, row, n)
        shared = _common_prefix(base, p.ids)
        assert shared >= n - max(nq0, p.n_question)
        assert shared >= n - longest_q
        assert shared < n  # the questions differ


def test_filler_is_prefix_consistent_across_n(tok, rows):
    row = rows[10]
    m = min_prompt_tokens(tok, row)
    big = build_exact_prompt(tok, row, m + 20_000)
    for n in (m, m + 1, m + 17, m + 4_000, m + 19_999):
        p = layout_exact_prompt(tok, row, n)
        assert p.ids[:p.question_start] == big[:p.question_start]


def test_seed_changes_filler_only(tok, rows):
    row = rows[1]
    a = layout_exact_prompt(tok, row, 3000, filler_seed=0)
    b = layout_exact_prompt(tok, row, 3000, filler_seed=1)
    assert a.ids == build_exact_prompt(tok, row, 3000)  # deterministic, default seed 0
    assert len(b.ids) == 3000 and b.ids != a.ids
    assert a.ids[:a.n_head] == b.ids[:b.n_head] and a.ids[-a.n_question:] == b.ids[-b.n_question:]


def test_message_list_string_and_system_turn(tok, rows):
    row = rows[2]
    n = 2048
    assert build_exact_prompt(tok, row.messages, n) == build_exact_prompt(tok, row, n)
    assert build_exact_prompt(tok, row.content, n) == build_exact_prompt(tok, row, n)
    msgs = [{"role": "system", "content": "You are a careful solver."}] + row.messages
    p = layout_exact_prompt(tok, msgs, n)
    assert len(p.ids) == n
    assert p.ids[:p.n_head] == tok.encode("[gMASK]<sop><|system|>\nYou are a careful solver.<|user|>\n")
    with pytest.raises(ValueError, match="last message must be a user message"):
        build_exact_prompt(tok, row.messages + [{"role": "assistant", "content": "ok"}], n)
    with pytest.raises(TypeError):
        build_exact_prompt(tok, [], n)


def test_glm5_template_exact(tok, rows):
    t5 = ChatTemplate.glm5()
    p = layout_exact_prompt(tok, rows[0], 5000, template=t5)
    assert len(p.ids) == 5000 and p.ids[:3] == [GMASK, SOP, USER]
    assert tok.decode(p.ids).endswith(rows[0].content + "<|assistant|><think>")


def test_two_million_tokens_fast(tok, rows):
    n = 2_097_152
    build_exact_prompt(tok, rows[0], 1000)  # warm the filler cache
    t0 = time.perf_counter()
    ids = build_exact_prompt(tok, rows[7], n)
    elapsed = time.perf_counter() - t0
    assert len(ids) == n and type(ids) is list and type(ids[12345]) is int
    arr = np.asarray(ids)
    assert arr.min() >= 0 and arr.max() < tok.vocab_size
    assert ids[-1] == ASSISTANT and ids[:3] == [GMASK, SOP, USER]
    assert int((arr < 7).sum()) == 4  # still one user turn
    assert elapsed < 5.0, elapsed
