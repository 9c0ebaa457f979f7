"""The per-step scalars: clip fractions split by side agree with the loss's own count; search scalars."""

import jax.numpy as jnp
import numpy as np
import pytest

from glm52_jax.rl import grpo
from glm52_jax.rl.step_metrics import clip_fractions, search_scalars, update_scalars


def _batch(seed=0):
    """logp, old [4,16] with ratios spread around the clip range, advantages [4] of both signs, a ragged mask."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 0.5, (4, 16))
    logp = old + rng.normal(0.0, 0.3, (4, 16))
    advantages = np.array([1.0, -1.0, 0.5, -0.5])
    mask = (np.arange(16)[None, :] < np.array([16, 12, 9, 5])[:, None]).astype(np.float32)
    return logp, old, advantages, mask


def test_clip_fractions_split_the_losss_clipfrac():
    logp, old, advantages, mask = _batch()
    fractions = clip_fractions(logp, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    _, metrics = grpo.policy_loss(jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
                                  jnp.asarray(advantages, jnp.float32), jnp.asarray(mask), clip_ratio_low=0.2,
                                  clip_ratio_high=0.28, clip_ratio_c=3.0)
    assert fractions["clipfrac_low"] > 0.05 and fractions["clipfrac_high"] > 0.05  # both sides occur
    assert fractions["clipfrac_low"] + fractions["clipfrac_high"] == pytest.approx(float(metrics["clipfrac"]))
    # By hand: A > 0 tokens above 1 + high.
    ratio, valid = np.exp(logp - old), mask > 0
    high = (advantages[:, None] > 0) & (ratio > 1.28) & valid
    assert fractions["clipfrac_high"] == pytest.approx(high.sum() / valid.sum())


def test_update_scalars_kl_is_zero_only_without_a_move():
    logp, old, advantages, mask = _batch(1)
    metrics = {"clipfrac_lower": 0.0, "approx_kl": 0.0}
    still = update_scalars(update_logp=old, old_logp=old, new_logp=old * mask, advantages=advantages, mask=mask,
                           clip_ratio_low=0.2, clip_ratio_high=0.28, policy_metrics=metrics)
    moved = update_scalars(update_logp=old, old_logp=old, new_logp=logp * mask, advantages=advantages, mask=mask,
                           clip_ratio_low=0.2, clip_ratio_high=0.28, policy_metrics=metrics)
    assert still["kl_after_update"] == 0.0 and still["clipfrac_low"] == still["clipfrac_high"] == 0.0
    d = (logp - old)[mask > 0]
    assert moved["kl_after_update"] == pytest.approx(np.mean(np.expm1(d) - d)) and moved["kl_after_update"] > 0
    assert still["sampled_entropy"] == pytest.approx(-old[mask > 0].mean())


def test_search_scalars_sum_the_candidates_timed_events():
    candidates = [{"rewards": [1.0, 1.0], "lengths": [4, 6], "prefix_hit_tokens": 0},
                  {"rewards": [1.0, -1.0], "lengths": [8, 2], "prefix_hit_tokens": 64}]
    events = [{"event": "step_start"},
              {"event": "candidate", "prefill_seconds": 0.5, "decode_seconds": 0.25, "reward_seconds": 0.01},
              {"event": "candidate", "prefill_seconds": 0.25, "decode_seconds": 0.25, "reward_seconds": 0.02},
              {"event": "probe", "prefill_seconds": 1.0, "decode_seconds": 0.5}]
    got = search_scalars(candidates, events, prompt_tokens=128)
    assert got == {"candidates_tried": 2, "reward_mean": 0.5, "reward_std": pytest.approx(np.std([1, 1, 1, -1])),
                   "prefill_seconds": 0.75, "decode_seconds": 0.5, "reward_seconds": 0.03, "probe_seconds": 1.5,
                   "prefill_tokens_per_s": round((128 + 64) / 0.75, 1), "decode_tokens_per_s": 40.0}
