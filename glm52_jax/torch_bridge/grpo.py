"""verl's GRPO / DAPO policy loss in torch (`compute_policy_loss_vanilla` + `agg_loss`), written from verl's
semantics for the PyTorch reference; independent of `glm52_jax.rl.grpo` (the JAX loss it is compared with).

Per token, with A the sequence's advantage and r = exp(clamp(logp - old, -20, 20)):

    pg = max(-A r, -A clip(r, 1 - low, 1 + high));   where A < 0 and dual clip c is set: pg = min(pg, -A c)

then aggregated over the valid tokens (mask != 0) of the whole [G,R] batch:

    token-mean               sum(pg) / #valid tokens
    seq-mean-token-sum       sum over sequences of sum_t pg, / #sequences with a valid token
    seq-mean-token-mean      sum over sequences of (sum_t pg / (n_tokens + 1e-8)), / #sequences with a valid token
    seq-mean-token-sum-norm  sum(pg) / norm_constant (default R, the padded response length)

Fully masked sequences do not count in the seq-mean denominators; an all-masked batch gives 0 (verl: NaN),
as in our JAX loss. Masked positions are replaced before any arithmetic, so padding values never reach the
loss or its gradient.

Axis letters: G sequences, R response tokens.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # verl clamps the log-ratio before exp
SEQ_MEAN_EPS = 1e-8  # verl's per-sequence epsilon in seq-mean-token-mean
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def token_losses(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, *,
                 clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> torch.Tensor:
    """Per-token clipped surrogate `[G,R]` (0 at masked positions); `adv: [G]`, `valid: [G,R]` bool."""
    adv = torch.where(valid, adv.detach()[:, None].to(logp.dtype), 0.0)
    log_ratio = torch.where(valid, logp - old, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    if clip_ratio_c is not None:  # dual clip bounds the loss of negative-advantage tokens from above
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * clip_ratio_c), pg)
    return torch.where(valid, pg, 0.0)


def aggregate(pg: torch.Tensor, mask: torch.Tensor, mode: str, norm_constant: float | None) -> torch.Tensor:
    """verl's agg_loss of `pg: [G,R]` (already 0 where masked) under `mask: [G,R]` (values multiply)."""
    weighted = pg * mask
    if mode == "token-mean":
        count = mask.sum()
        return weighted.sum() / torch.where(count > 0, count, 1.0)
    if mode == "seq-mean-token-sum-norm":
        constant = mask.shape[-1] if norm_constant is None else norm_constant
        if not constant > 0:
            raise ValueError(f"norm_constant must be > 0, got {norm_constant!r}")
        return weighted.sum() / constant
    seq_tokens = mask.sum(-1)  # [G]
    seq_losses = weighted.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (seq_tokens + SEQ_MEAN_EPS)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    seq_valid = seq_tokens > 0
    count = seq_valid.to(pg.dtype).sum()
    return torch.where(seq_valid, seq_losses, 0.0).sum() / torch.where(count > 0, count, 1.0)


def policy_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, loss) -> torch.Tensor:
    """The batch GRPO policy loss `[]`: `logp, old, mask: [G,R]`, `adv: [G]`; `loss`: a
    `glm52_jax.rl.gradients.LossSettings` (clip ratios, dual clip, aggregation mode, norm constant)."""
    mask = mask.to(logp.dtype)
    pg = token_losses(logp, old.to(logp.dtype), adv, mask != 0, clip_ratio_low=loss.clip_ratio_low,
                      clip_ratio_high=loss.clip_ratio_high, clip_ratio_c=loss.clip_ratio_c)
    return aggregate(pg, mask, loss.loss_agg_mode, loss.norm_constant)
