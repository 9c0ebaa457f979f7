"""The per-step scalars a person follows a run by (metrics.jsonl `step` records, TensorBoard).

Pure numpy on what a transaction already holds: the candidates' rewards and lengths, the timed events of
the step (`candidate` / `probe` records), and for an update the group's log-probs. Nothing here enters the
receipt (timings are nondeterministic; the receipt's training numbers are the reproducible ones).
"""

from __future__ import annotations

import numpy as np


def masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    """Mean of `x` over `mask > 0` (0.0 when the mask is empty)."""
    n = float(np.sum(mask > 0))
    return float(np.sum(np.where(mask > 0, x, 0.0)) / n) if n else 0.0


def _k3(log_ratio: np.ndarray) -> np.ndarray:
    """r - 1 - log r per token, from log r (clamped as the loss clamps it)."""
    d = np.clip(log_ratio, -20.0, 20.0)
    return np.expm1(d) - d


def clip_fractions(logp: np.ndarray, old_logp: np.ndarray, advantages: np.ndarray, mask: np.ndarray, *,
                   clip_ratio_low: float, clip_ratio_high: float) -> dict[str, float]:
    """Token fractions the PPO clip acts on, split by side: `logp`, `old_logp`, `mask`: [G,R]; `advantages`: [G].

    `clipfrac_high`: A > 0 and ratio > 1 + high (the update may not raise these tokens further);
    `clipfrac_low`: A < 0 and ratio < 1 - low. Their sum is `grpo.policy_loss`'s `clipfrac` (the clipped
    branch is strictly larger exactly there); the log-ratio is clamped as there.
    """
    ratio = np.exp(np.clip(np.asarray(logp, np.float64) - np.asarray(old_logp, np.float64), -20.0, 20.0))
    adv = np.broadcast_to(np.asarray(advantages, np.float64)[:, None], ratio.shape)
    return {"clipfrac_high": masked_mean((adv > 0) & (ratio > 1.0 + clip_ratio_high), mask),
            "clipfrac_low": masked_mean((adv < 0) & (ratio < 1.0 - clip_ratio_low), mask)}


def update_scalars(*, update_logp, old_logp, new_logp, advantages, mask, clip_ratio_low: float,
                   clip_ratio_high: float, policy_metrics: dict[str, float]) -> dict[str, float]:
    """The update's scalars. `update_logp` [G,R]: the trainer's log-probs the loss saw (before the step);
    `old_logp`: the sampler's; `new_logp`: after the step (zeros where `mask` is 0).

    `approx_kl`: verl's ppo_kl at the update (mean old - trainer log-prob; ~0 on policy); `kl_after_update`:
    how far the step moved the policy, KL(old || updated) estimated on the sampled tokens with Schulman's k3
    (r - 1 - log r, r = p_updated / p_old: unbiased and never negative, unlike the plain log-ratio);
    `clipfrac_dual`: tokens with A < 0 where the dual clip bounds the loss; `sampled_entropy`: mean
    -log p(sampled token) under the sampling policy, a Monte-Carlo estimate of its entropy (top-p biases it).
    """
    old = np.asarray(old_logp, np.float64)
    return {**clip_fractions(update_logp, old, advantages, mask, clip_ratio_low=clip_ratio_low,
                             clip_ratio_high=clip_ratio_high),
            "clipfrac_dual": float(policy_metrics["clipfrac_lower"]),
            "approx_kl": float(policy_metrics["approx_kl"]),
            "kl_after_update": masked_mean(_k3(np.asarray(new_logp, np.float64) - old), mask),
            "sampled_entropy": masked_mean(-old, mask)}


def search_scalars(candidates: list[dict], events: list[dict], *, prompt_tokens: int) -> dict[str, float]:
    """Rewards, phase times and throughput of the candidate search (and the engine probe, if run).

    `candidates`: the search's records (rewards, lengths, prefix_hit_tokens per candidate); `events`: the
    step's timed records (`candidate` ones carry prefill / decode / reward seconds, `probe` its two).
    `reward_mean` / `reward_std`: over every sample the step scored (all candidates tried).
    """
    rewards = np.asarray([r for cd in candidates for r in cd["rewards"]], np.float64)
    timed = [e for e in events if e["event"] == "candidate"]
    prefill = sum(e["prefill_seconds"] for e in timed)
    decode = sum(e["decode_seconds"] for e in timed)
    generated = sum(sum(cd["lengths"]) for cd in candidates)
    prefilled = sum(prompt_tokens - cd["prefix_hit_tokens"] for cd in candidates)
    probe = [e["prefill_seconds"] + e["decode_seconds"] for e in events if e["event"] == "probe"]
    return {"candidates_tried": len(candidates),
            "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward_std": float(rewards.std()) if rewards.size else 0.0,
            "prefill_seconds": round(prefill, 3), "decode_seconds": round(decode, 3),
            "reward_seconds": round(sum(e.get("reward_seconds", 0.0) for e in timed), 3),
            **({"probe_seconds": round(sum(probe), 3)} if probe else {}),
            "prefill_tokens_per_s": round(prefilled / prefill, 1) if prefill > 0 else 0.0,
            "decode_tokens_per_s": round(generated / decode, 1) if decode > 0 else 0.0}
