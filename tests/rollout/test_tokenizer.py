"""Tokenizer wrapper, GLM chat formatting, and the shipped tiny byte-level BPE."""

import random
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import glm52_jax
from glm52_jax.rollout.tokenizer import SPECIAL_TOKENS, ChatTemplate, Tokenizer, default_tokenizer_path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_tokenizer.py"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


def test_shipped_tokenizer_geometry(tok):
    assert default_tokenizer_path() == REPO / "glm52_jax" / "assets" / "tokenizer.json"
    assert tok.vocab_size == 512 == glm52_jax.tiny().vocab_size
    assert SPECIAL_TOKENS == ("[gMASK]", "<|endoftext|>", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                              "<|pad|>")
    assert tok.special_tokens == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == list(range(7))
    # GLM stop set: <|endoftext|>, <|user|> (<|observation|> is absent from the tiny vocabulary).
    assert tok.eos_ids == (1, 4)
    assert tok.pad_id == 6
    cfg = glm52_jax.tiny()
    assert cfg.bos_token_id == tok.token_id("[gMASK]")
    assert set(cfg.eos_token_id) <= set(tok.eos_ids)


def test_special_tokens_are_single_ids(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.encode(t) == [i]
        assert tok.decode([i]) == t
    ids = tok.encode("ab<|user|>cd<|assistant|>")
    assert ids.count(4) == 1 and ids[-1] == 5
    assert tok.decode(ids) == "ab<|user|>cd<|assistant|>"
    assert tok.decode(ids, skip_special_tokens=True) == "abcd"


def test_encode_adds_no_special_tokens(tok):
    assert tok.encode("") == []
    ids = tok.encode("hello world")
    assert not set(ids) & set(range(7))
    assert tok.decode(ids) == "hello world"
    assert tok.encode_batch(["hello world", "7 + 5"]) == [ids, tok.encode("7 + 5")]


def test_digits_are_single_tokens(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_byte_level_round_trip_arbitrary_unicode(tok):
    fixed = ["", " ", "\n\n\t ", "héllo wörld", "数学题：２＋２＝？", "emoji 🙂👍🏽 and ZWJ 👩‍👩‍👧", "e\u0301\u0323",
             "\x00\x01\x7f control", "Ω≈ç√∫˜µ≤≥÷", "مرحبا بالعالم", "$\\frac{m}{n}$ \\binom{8}{4}", "\ufeffBOM",
             "trailing spaces   "]
    rng = random.Random(0)
    rand = []
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 40)):
            cp = rng.randint(0, 0x10FFFF)
            if 0xD800 <= cp <= 0xDFFF:  # surrogates are not encodable text
                cp = 0x41
            chars.append(chr(cp))
        rand.append("".join(chars))
    for s in fixed + rand:
        ids = tok.encode(s)
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == s, repr(s)


def test_token_id_errors(tok):
    with pytest.raises(KeyError, match="not a single token"):
        tok.token_id("<|observation|>")
    with pytest.raises(KeyError):
        tok.token_id("definitely not one token")


def test_load_from_directory_and_missing(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(default_tokenizer_path().read_bytes())
    t = Tokenizer(d)
    assert t.vocab_size == 512 and t.encode("2 + 2") == Tokenizer.default().encode("2 + 2")
    with pytest.raises(FileNotFoundError):
        Tokenizer(tmp_path / "nope")


def test_default_chat_template_glm45_layout(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    text = tok.render_chat(msgs)
    assert text == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nWhat is 2+2?<|assistant|>\n4"
                    "<|user|>\nAnd 3+3?<|assistant|>")
    ids = tok.apply_chat_template(msgs)
    assert ids == tok.encode(text)
    assert ids[:3] == [0, 2, 3] and ids[-1] == 5
    assert [i for i in ids if i < 7] == [0, 2, 3, 4, 5, 4, 5]
    one = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert one == [0, 2, 4] + tok.encode("\nWhat is 2+2?") + [5]
    no_gen = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=False)
    assert no_gen == one[:-1]


def test_glm5_template_and_braces(tok):
    t5 = ChatTemplate.glm5()
    assert t5.render([{"role": "user", "content": "hi"}]) == "[gMASK]<sop><|user|>hi<|assistant|><think>"
    assert ChatTemplate.glm5(thinking=False).generation_prompt == "<|assistant|></think>"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], template=t5)
    assert ids[:3] == [0, 2, 4] and tok.decode(ids).endswith("<|assistant|><think>")
    # Content is inserted literally: braces and the placeholder text are not re-expanded.
    assert tok.render_chat([{"role": "user", "content": "{content} {x}"}]) == \
        "[gMASK]<sop><|user|>\n{content} {x}<|assistant|>"


def test_chat_template_validation(tok):
    with pytest.raises(ValueError, match="exactly once"):
        ChatTemplate(user="<|user|>\n")
    with pytest.raises(ValueError, match="unknown chat role 'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="'content' must be a str"):
        tok.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="mapping"):
        tok.apply_chat_template(["hello"])


def test_training_script_matches_module_constants():
    ns = runpy.run_path(str(SCRIPT), run_name="train_tokenizer")
    assert tuple(ns["SPECIAL_TOKENS"]) == SPECIAL_TOKENS
    assert ns["VOCAB_SIZE"] == 512


def test_shipped_tokenizer_is_reproducible(tmp_path):
    """Training in a fresh process (other hash seed) gives byte-identical output to the shipped file."""
    out = tmp_path / "tokenizer.json"
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, env=env, capture_output=True,
                   timeout=120)
    assert out.read_bytes() == default_tokenizer_path().read_bytes(), \
        "shipped tokenizer is stale: rerun `python scripts/train_tokenizer.py`"
