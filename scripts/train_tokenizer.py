#!/usr/bin/env python
"""(Re)build the shipped tiny tokenizer, `glm52_jax/assets/tokenizer.json`, deterministically.

A byte-level BPE with exactly 512 ids (the tiny model's vocab_size): the 7 GLM special tokens at
ids 0..6 (`glm52_jax.rollout.tokenizer.SPECIAL_TOKENS`), the 256 byte symbols, then 249 merges.
Pre-tokenization: every digit is its own piece (helps arithmetic), then GPT-2-style byte-level
splitting. Decoding is byte-level, so every string round-trips and nothing is ever unknown.

The corpus is written by this project: the shipped math problems (DAPO wording), generated
arithmetic worked solutions, and generated English filler. Every random choice comes from a fixed
seed, so two runs write identical bytes (tests/rollout/test_tokenizer.py checks this against the
shipped file; if you change the corpus or the problems, rerun this script and commit the result).

    python scripts/train_tokenizer.py                 # rewrites glm52_jax/assets/tokenizer.json
    python scripts/train_tokenizer.py --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "glm52_jax" / "assets"
VOCAB_SIZE = 512

# Keep in sync with glm52_jax.rollout.tokenizer.SPECIAL_TOKENS (the test checks it); duplicated
# here so the script does not import the package (and with it JAX).
SPECIAL_TOKENS = ("[gMASK]", "<|endoftext|>", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>")

_SUBJECTS = ["The farmer", "A student", "The baker", "My neighbor", "The teacher", "A small robot", "The captain",
             "An old clock", "The river", "A quiet village", "The library", "Every morning, the market",
             "The gardener", "A traveler", "The engineer"]
_VERBS = ["counts", "carries", "measures", "divides", "collects", "shares", "arranges", "paints", "builds",
          "writes down", "compares", "adds up", "checks", "records", "prepares"]
_OBJECTS = ["the apples in each basket", "a list of numbers", "the length of the fence", "three red boxes",
            "the coins on the table", "a long row of tiles", "the pages of a book", "the seeds for spring",
            "the total cost of the trip", "the angles of a triangle", "a pile of wooden blocks",
            "the answer on its own line", "the pieces of a puzzle", "the steps of the solution"]
_TAILS = ["before noon.", "with great care.", "and then rests.", "one step at a time.", "while it rains.",
          "for the second time.", "without any mistakes.", "near the old bridge.", "in the evening light.",
          "as the bell rings."]


def _problem_texts() -> list[str]:
    texts = []
    with open(ASSETS / "math_problems.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                texts.extend(m["content"] for m in row["prompt"])
                texts.append("Answer: " + row["reward_model"]["ground_truth"])
    return texts


def _arithmetic_texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        op = rng.choice("+-*/")
        if op == "+":
            expr, val = f"{a} + {b}", a + b
        elif op == "-":
            expr, val = f"{a} - {b}", a - b
        elif op == "*":
            expr, val = f"{a} \\times {b}", a * b
        else:
            a = a - a % b
            expr, val = f"{a} / {b}", a // b
        out.append(f"We compute ${expr} = {val}$. So the result is {val}.\nAnswer: {val}")
    return out


def _filler_texts(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
            for _ in range(n)]


def corpus() -> list[str]:
    rng = random.Random(52)
    return _problem_texts() + _arithmetic_texts(rng, 3000) + _filler_texts(rng, 3000)


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tok.get_vocab_size(with_added_tokens=True)} ids, want {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, want {i}")
    return tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ASSETS / "tokenizer.json"), help="output tokenizer.json path")
    args = ap.parse_args(argv)
    text = build_tokenizer().to_str(pretty=True) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    print(f"wrote {out} ({len(text.encode())} bytes, vocab {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
