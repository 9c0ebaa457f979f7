"""What parity starts from: a nonzero LoRA state, and the seed's two cases on one rollout group.

A fresh adapter has B = 0, so every gradient of A is exactly zero in every mode and half of a
comparison would be empty. Parity therefore runs from the adapter `model.init_adapter` names or,
without one, from the fresh A plus B drawn N(0, std^2) with a seeded key (the receipt records both).

The two cases share the group's tokens, mask and advantages and differ only in the old log-probs:

  ratio1       old = the current policy's own log-probs of the responses, so every ratio is 1 (up to
               the float differences between the cached and the full-sequence forward).
  active_clip  old = those log-probs shifted per valid token so that, with positive and negative
               advantages, the clipped branches are active: for A > 0 every third token has
               ratio e^0.6 = 1.82 (above 1 + clip_ratio_high: clipped high); for A < 0 every fourth token
               has ratio e^-0.6 = 0.55 (below 1 - clip_ratio_low: clipped low) and the next one ratio
               e^1.5 = 4.5 (above the dual-clip constant 3); the others move by +-0.1 (unclipped).

`clip_counts` counts, from the new log-probs, the tokens each clip acted on; the receipt records them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

CASES = ("ratio1", "active_clip")
_HIGH, _LOW, _DUAL, _SMALL = 0.6, 0.6, 1.5, 0.1


def seed_lora_b(model, std: float, seed: int) -> int:
    """Draws every LoRA B (`b`, `b_k`, `b_v`) N(0, std^2) from `seed`, in place, each array with its own
    sharding (jitted, so every process of a run draws the same values); returns how many arrays."""
    import jax
    from flax import nnx

    from glm52_jax.model.lora import LoRA

    state = nnx.state(model, LoRA)
    flat = [(path, var) for path, var in nnx.to_flat_state(state) if str(path[-1]).startswith("b")]
    keys = jax.random.split(jax.random.key(seed), len(flat))
    for key, (_, var) in zip(keys, flat):
        value = var.get_value()
        draw = jax.jit(lambda k, shape=value.shape, dtype=value.dtype:
                       (std * jax.random.normal(k, shape)).astype(dtype), out_shardings=value.sharding)
        var.set_value(draw(key))
    nnx.update(model, state)
    return len(flat)


def active_clip_old(policy_logprobs: np.ndarray, mask: np.ndarray, advantages: np.ndarray) -> np.ndarray:
    """Old log-probs [G,R] that make the clips act (see the module docstring); masked tokens keep theirs."""
    old = np.asarray(policy_logprobs, np.float32).copy()
    for g, adv in enumerate(np.asarray(advantages)):
        valid = np.flatnonzero(np.asarray(mask[g]) != 0)
        for i, t in enumerate(valid):
            if adv > 0:
                shift = -_HIGH if i % 3 == 0 else (_SMALL if i % 3 == 2 else 0.0)
            elif adv < 0:
                shift = (_LOW, -_DUAL, _SMALL, -_SMALL)[i % 4]
            else:
                shift = 0.0
            old[g, t] += shift
    return old


def clip_counts(new_logprobs: np.ndarray, old_logprobs: np.ndarray, mask: np.ndarray, advantages: np.ndarray, *,
                clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> dict[str, int]:
    """Valid tokens whose ratio exp(new - old) sits beyond a clip that acts on their advantage's sign:
    high (A > 0, ratio > 1 + high), low (A < 0, ratio < 1 - low), dual (A < 0, ratio > c)."""
    valid = np.asarray(mask) != 0
    ratio = np.exp(np.asarray(new_logprobs, np.float64) - np.asarray(old_logprobs, np.float64))
    adv = np.broadcast_to(np.asarray(advantages, np.float64)[:, None], ratio.shape)
    pos, neg = valid & (adv > 0), valid & (adv < 0)
    dual = int(np.count_nonzero(neg & (ratio > clip_ratio_c))) if clip_ratio_c is not None else 0
    return {"tokens": int(valid.sum()), "high": int(np.count_nonzero(pos & (ratio > 1 + clip_ratio_high))),
            "low": int(np.count_nonzero(neg & (ratio < 1 - clip_ratio_low))), "dual": dual}


def case_olds(policy_logprobs: np.ndarray, mask: np.ndarray, advantages: np.ndarray) -> dict[str, np.ndarray]:
    """The old log-probs [G,R] of every case."""
    ratio1 = np.where(np.asarray(mask) != 0, policy_logprobs, 0.0).astype(np.float32)
    return {"ratio1": ratio1, "active_clip": active_clip_old(ratio1, mask, advantages)}


def describe_cases() -> dict[str, Any]:
    """How the cases' old log-probs were made (recorded in the receipt)."""
    return {"ratio1": "old = the current policy's log-probs (cached prompt KV of the sampler, same LoRA)",
            "active_clip": f"old = ratio1 old shifted per valid token: A>0 every 3rd by -{_HIGH} (clipped high), "
                           f"A<0 every 4th by +{_LOW} (clipped low) and the next by -{_DUAL} (dual clip), "
                           f"others by 0 or +-{_SMALL}"}
