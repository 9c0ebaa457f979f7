"""The shipped tiny SFT policy (`glm52_jax/assets/tiny_policy`, made by scripts/train_tiny_policy.py):
it loads, writes `Answer:` lines, and at T=1.0 is right part of the time (mixed GRPO rewards)."""

import json
import os
from importlib import resources

import jax.numpy as jnp
import numpy as np
import pytest

from glm52_jax.checkpoint.hf import load_pretrained
from glm52_jax.config import ModelConfig, tiny
from glm52_jax.dapo_data import load_rows
from glm52_jax.rl.prompts import build_exact_prompt, min_prompt_tokens
from glm52_jax.rl.rewards.dapo import compute_score
from glm52_jax.rollout.sampler import Sampler, SamplingParams
from glm52_jax.rollout.tokenizer import Tokenizer

PROMPT_TOKENS = 256  # the length the policy was trained at (also N + 64); see TRAINING.md
ROWS = (0, 5, 6, 15, 17, 19)  # rows with T=1.0 accuracy 50-75% in the training-time eval
G = 4
SEED = 0


def policy_dir() -> str:
    return os.fspath(resources.files("glm52_jax").joinpath("assets", "tiny_policy"))


@pytest.fixture(scope="module")
def policy():
    path = policy_dir()
    assert os.path.isfile(os.path.join(path, "config.json")), f"no shipped tiny policy at {path}"
    return load_pretrained(path, dtype=jnp.float32)


def test_checkpoint_is_tiny_architecture_and_small():
    path = policy_dir()
    cfg = ModelConfig.from_json_file(os.path.join(path, "config.json"))
    assert cfg == tiny()
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size < 8 * 2**20, size
    assert os.path.isfile(os.path.join(path, "TRAINING.md"))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_type"] == "glm_moe_dsa"


def test_prompt_length_fits_every_bundled_row():
    tok = Tokenizer.default()
    assert max(min_prompt_tokens(tok, r) for r in load_rows()) <= PROMPT_TOKENS


def test_sampled_answers_have_mixed_rewards(policy):
    tok = Tokenizer.default()
    rows = load_rows(select=list(ROWS))
    sampler = Sampler(policy)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, num_samples=G, seed=SEED,
                            stop_token_ids=tuple(policy.cfg.eos_token_id))
    scores, with_answer, texts = [], 0, []
    for row in rows:
        res = sampler.sample(build_exact_prompt(tok, row, PROMPT_TOKENS), params)
        for g in range(G):
            text = tok.decode(res.completion(g), skip_special_tokens=True)
            texts.append((row.ground_truth, text))
            with_answer += "Answer:" in text
            scores.append(compute_score(text, row.ground_truth)["score"])
    scores = np.asarray(scores)
    assert with_answer >= 0.75 * len(scores), texts
    assert (scores > 0).any() and (scores < 0).any(), texts
    assert 0.1 <= float(np.mean(scores > 0)) <= 0.9, texts
