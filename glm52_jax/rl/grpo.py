"""GRPO / DAPO losses in pure ``jax.numpy``, following verl's semantics.

Everything here is jit-safe: there is no Python control flow on traced values. The string and
clip arguments (aggregation mode, KL kind, clip ratios) are *static* Python values, validated at
trace time with a ``ValueError`` that names the offending argument; numeric tensors may be traced.

Reference semantics: verl ``verl/trainer/ppo/core_algos.py`` (snapshot b178a3cd) —
``compute_grpo_outcome_advantage``, ``compute_policy_loss_vanilla``, ``agg_loss``,
``kl_penalty``; and ``verl/utils/torch_functional.py::entropy_from_logits``. The implementation
below is our own; where we depart from verl it is only for inputs on which verl produces NaN (a
fully masked batch) and is stated in the function's docstring.

Axis letters used in shape docs:
  N  sequences (responses) in the batch; G sequences of one group (prompt), N = (#groups) * G
  T  response tokens (padded)
  V  vocabulary

The per-token loss mask ``mask [N,T]`` may be bool or float; only positions with ``mask != 0``
contribute (values there are multiplied by the mask, as verl does), and positions with
``mask == 0`` are excluded with ``jnp.where`` so NaN/inf there never leak into the loss or its
gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from glm52_jax import choices

__all__ = [
    "LOSS_AGG_MODES",
    "KL_KINDS",
    "group_advantages",
    "agg_loss",
    "policy_loss",
    "kl_penalty",
    "entropy_from_logits",
    "grpo_loss",
]

LOSS_AGG_MODES = choices.LOSS_AGG_MODES
# Base kinds; any of them may carry a "+" suffix (straight-through k2 gradient), like verl.
KL_KINDS = ("k1", "kl", "k2", "mse", "abs", "k3", "low_var_kl")

# verl clamps the log-ratio before exp (policy loss and k3) and the k3 value itself.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
# verl's masked_mean denominator epsilon (metrics) and seq-mean-token-mean per-seq epsilon.
_MASKED_MEAN_EPS = 1e-8


# --------------------------------------------------------------------------------------------
# static-argument validation
# --------------------------------------------------------------------------------------------


def _static_float(name: str, value: Any) -> float:
    """``float(value)`` for a static argument, with an error naming ``name`` if it is traced."""
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:  # traced or non-numeric
        raise TypeError(f"{name} must be a static Python number, got {value!r}") from e


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}"
        )


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None):
    low = _static_float("clip_ratio_low", clip_ratio_low)
    high = _static_float("clip_ratio_high", clip_ratio_high)
    if not low >= 0.0:
        raise ValueError(f"clip_ratio_low must be >= 0, got {clip_ratio_low!r}")
    if not high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high!r}")
    c = None
    if clip_ratio_c is not None:
        c = _static_float("clip_ratio_c", clip_ratio_c)
        if not c > 1.0:
            raise ValueError(
                f"clip_ratio_c must be > 1 (dual-clip lower bound) or None, got {clip_ratio_c!r}"
            )
    return low, high, c


def _check_2d(name: str, x: jax.Array, shape: tuple[int, ...] | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N,T], got shape {x.shape}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {x.shape}, expected {shape}")


# --------------------------------------------------------------------------------------------
# masked reductions
# --------------------------------------------------------------------------------------------


def _masked_sum(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Σ values·mask over ``axis`` with masked-out positions replaced by 0 first (NaN-safe)."""
    w = mask.astype(values.dtype)
    return jnp.sum(jnp.where(mask != 0, values, 0.0) * w, axis=axis)


def _masked_mean(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """verl's masked_mean: Σ(values·mask) / (Σ mask + 1e-8); 0 for an all-masked input."""
    count = jnp.sum(mask.astype(values.dtype), axis=axis)
    return _masked_sum(values, mask, axis) / (count + _MASKED_MEAN_EPS)


def _safe_denominator(count: jax.Array) -> jax.Array:
    """``count`` where positive, else 1 (keeps all-masked batches at loss 0 instead of NaN)."""
    return jnp.where(count > 0, count, jnp.ones_like(count))


# --------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------


def group_advantages(
    rewards: jax.Array,
    group_ids: jax.Array | None = None,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> jax.Array:
    """GRPO outcome advantages, one scalar per sequence: ``rewards [N] -> advantages [N]``.

    For each group (sequences sharing a prompt)::

        A_i = (r_i - mean_g) / (std_g + eps)     if norm_by_std (original GRPO, verl default)
        A_i =  r_i - mean_g                      otherwise (Dr.GRPO)

    with ``std_g`` the *unbiased* (n-1, Bessel-corrected) standard deviation, as ``torch.std``.

    Singleton groups follow verl exactly: verl sets mean 0 and std 1 for a group of size 1, so
    its advantage is ``r / (1 + eps)`` (``r`` when ``norm_by_std=False``), **not** 0. Filter
    singleton groups out upstream if you want them to carry no signal.

    Groups are given either by
      * ``group_ids [N]`` (any integer labels, groups need not be contiguous: each sequence is
        compared with every other, O(N^2) work, fine for RL batch sizes), or
      * ``group_size=G`` (static int): sequences ``[k*G, (k+1)*G)`` form group k; N % G == 0.

    The result is wrapped in ``stop_gradient`` (verl computes it under ``torch.no_grad``).
    Broadcast to tokens with ``A[:, None]``; ``policy_loss`` accepts the [N] form directly.
    """
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {rewards.shape}")
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        rewards = rewards.astype(jnp.float32)
    eps = _static_float("eps", eps)
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids or group_size")
    r = jax.lax.stop_gradient(rewards)
    n = r.shape[0]

    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if n % group_size != 0:
            raise ValueError(f"group_size={group_size} does not divide N={n}")
        rg = r.reshape(n // group_size, group_size)  # [N/G, G]
        count = jnp.full((n // group_size, 1), group_size, dtype=r.dtype)
        mean = jnp.mean(rg, axis=1, keepdims=True)
        ss = jnp.sum(jnp.square(rg - mean), axis=1, keepdims=True)
        rg_out = _normalise(rg, mean, ss, count, eps, norm_by_std)
        return jax.lax.stop_gradient(rg_out.reshape(n))

    group_ids = jnp.asarray(group_ids)
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape {(n,)}, got {group_ids.shape}")
    same = (group_ids[:, None] == group_ids[None, :]).astype(r.dtype)  # [N, N]
    count = jnp.sum(same, axis=1)  # [N], >= 1 (diagonal)
    mean = (same @ r) / count
    ss = jnp.sum(same * jnp.square(r[None, :] - mean[:, None]), axis=1)
    return jax.lax.stop_gradient(_normalise(r, mean, ss, count, eps, norm_by_std))


def _normalise(r, mean, ss, count, eps, norm_by_std):
    singleton = count < 2
    mean = jnp.where(singleton, 0.0, mean)
    centred = r - mean
    if not norm_by_std:
        return centred
    var = ss / jnp.where(singleton, 1.0, count - 1.0)
    std = jnp.where(singleton, 1.0, jnp.sqrt(var))
    return centred / (std + eps)


# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: jax.Array,
    mask: jax.Array,
    mode: str = "token-mean",
    *,
    norm_constant: float | jax.Array | None = None,
    num_tokens: float | jax.Array | None = None,
    num_seqs: float | jax.Array | None = None,
) -> jax.Array:
    """Reduce a per-token loss ``loss_mat [N,T]`` under ``mask [N,T]`` to a scalar (verl agg_loss).

    Modes (L = loss_mat, M = mask, n_t = Σ_t M[i,t]):
      * ``"token-mean"``: Σ_{i,t} L·M / Σ_{i,t} M  — one mean over every valid token (DAPO).
      * ``"seq-mean-token-sum"``: Σ_i [n_i>0]·Σ_t L·M / #{i : n_i > 0}.
      * ``"seq-mean-token-mean"``: Σ_i [n_i>0]·(Σ_t L·M / (n_i + 1e-8)) / #{i : n_i > 0}.
      * ``"seq-mean-token-sum-norm"``: Σ_{i,t} L·M / C (Dr.GRPO constant normaliser). ``C`` is
        ``norm_constant`` if given, else ``T = mask.shape[-1]`` (the padded response length),
        as verl does with ``loss_scale_factor=None``. Set a constant (e.g. the max response
        length) to keep the scale independent of how much a batch happens to be padded.

    Fully masked sequences are excluded from the seq-mean denominators (as verl does).

    ``num_tokens`` / ``num_seqs`` override the token-mean / seq-mean denominators (verl's
    ``batch_num_tokens`` / ``global_batch_size``): pass global counts when a step is split into
    micro-batches so that summing micro-batch losses gives the global mean. They may be traced.

    Deviation from verl: when the default denominator is 0 (no valid token / sequence) we
    divide by 1 and return 0 instead of verl's NaN.

    ``mode`` is static; an unknown mode raises ``ValueError`` listing the allowed modes.
    """
    _check_mode(mode)
    _check_2d("loss_mat", loss_mat)
    _check_2d("mask", mask, loss_mat.shape)
    dtype = loss_mat.dtype
    w = mask.astype(dtype)

    if mode == "token-mean":
        total = _masked_sum(loss_mat, mask)
        if num_tokens is None:
            denom = _safe_denominator(jnp.sum(w))
        else:
            denom = jnp.asarray(num_tokens, dtype)
        return total / denom

    if mode == "seq-mean-token-sum-norm":
        total = _masked_sum(loss_mat, mask)
        c = mask.shape[-1] if norm_constant is None else norm_constant
        if isinstance(c, (int, float)) and not c > 0:
            raise ValueError(f"norm_constant must be > 0, got {norm_constant!r}")
        return total / jnp.asarray(c, dtype)

    seq_tokens = jnp.sum(w, axis=-1)  # [N]
    seq_sums = _masked_sum(loss_mat, mask, axis=-1)  # [N]
    if mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    else:  # seq-mean-token-mean
        seq_losses = seq_sums / (seq_tokens + _MASKED_MEAN_EPS)
    seq_valid = seq_tokens > 0
    total = jnp.sum(jnp.where(seq_valid, seq_losses, 0.0))
    if num_seqs is None:
        denom = _safe_denominator(jnp.sum(seq_valid.astype(dtype)))
    else:
        denom = jnp.asarray(num_seqs, dtype)
    return total / denom


# --------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------


def policy_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    norm_constant: float | jax.Array | None = None,
    num_tokens: float | jax.Array | None = None,
    num_seqs: float | jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped PPO surrogate with optional dual clip (verl ``compute_policy_loss_vanilla``).

    Args:
      logp_new: [N,T] trainer log-probs of the sampled tokens (differentiated).
      logp_old: [N,T] behaviour (sampler / old-policy) log-probs.
      advantages: [N] (broadcast over T) or [N,T].
      mask: [N,T] response-token mask.
      clip_ratio_low, clip_ratio_high: ratio clipped to [1 - low, 1 + high]; defaults are DAPO's
        Clip-Higher (0.2, 0.28). verl's own defaults are 0.2 / 0.2.
      clip_ratio_c: dual-clip constant (> 1), or ``None`` to disable dual clip.
      loss_agg_mode, norm_constant, num_tokens, num_seqs: see ``agg_loss``.

    Per token::

        log_r  = clip(logp_new - logp_old, -20, 20)          # verl's stability clamp
        ratio  = exp(log_r)
        pg     = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
        pg     = min(pg, -A * c)   where A < 0 (dual clip, only if clip_ratio_c is not None)

    Returns ``(loss, metrics)``; metrics are masked token means (verl ``masked_mean``):
      * ``clipfrac``: fraction of tokens where the clipped branch is strictly larger,
      * ``clipfrac_lower``: fraction with A < 0 where the dual clip is active (0 if disabled),
      * ``approx_kl``: mean of ``-log_r`` (verl ``ppo_kl``, on the clamped log-ratio),
      * ``pg_loss``: the returned loss.
    """
    low, high, c = _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    _check_mode(loss_agg_mode)
    _check_2d("logp_new", logp_new)
    shape = logp_new.shape
    _check_2d("logp_old", logp_old, shape)
    _check_2d("mask", mask, shape)
    if advantages.shape == (shape[0],):
        advantages = advantages[:, None]
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages must have shape {(shape[0],)} or {shape}, got {advantages.shape}"
        )
    dtype = jnp.result_type(logp_new.dtype, logp_old.dtype, jnp.float32)
    logp_new = logp_new.astype(dtype)
    logp_old = logp_old.astype(dtype)
    # Neutralise masked positions *before* any arithmetic (log-ratio 0, advantage 0), so that
    # NaN/inf padding there cannot reach the gradient through 0 * NaN in the backward pass.
    valid = mask != 0
    adv = jnp.where(valid, jax.lax.stop_gradient(advantages.astype(dtype)), 0.0)
    raw_log_ratio = jnp.where(valid, logp_new - logp_old, 0.0)

    log_ratio = jnp.clip(raw_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    clipped = jnp.maximum(pg1, pg2)
    clipfrac = _masked_mean((pg2 > pg1).astype(dtype), mask)

    if c is not None:
        pg3 = -adv * c
        negative = adv < 0
        pg_losses = jnp.where(negative, jnp.minimum(pg3, clipped), clipped)
        clipfrac_lower = _masked_mean(((clipped > pg3) & negative).astype(dtype), mask)
    else:
        pg_losses = clipped
        clipfrac_lower = jnp.zeros((), dtype)

    loss = agg_loss(
        pg_losses,
        mask,
        loss_agg_mode,
        norm_constant=norm_constant,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    metrics = {
        "pg_loss": loss,
        "clipfrac": clipfrac,
        "clipfrac_lower": clipfrac_lower,
        "approx_kl": _masked_mean(-log_ratio, mask),
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# KL and entropy
# --------------------------------------------------------------------------------------------


def _check_kl_kind(kind: str) -> tuple[str, bool]:
    """Validate a KL kind; returns (base kind, straight-through flag)."""
    ok = isinstance(kind, str) and (kind[:-1] if kind.endswith("+") else kind) in KL_KINDS
    if not ok:
        raise ValueError(f"kl kind must be one of {KL_KINDS} (optionally with '+'), got {kind!r}")
    return (kind[:-1], True) if kind.endswith("+") else (kind, False)


def _kl_forward(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    if kind in ("k1", "kl"):
        return logp - ref_logp
    if kind == "abs":
        return jnp.abs(logp - ref_logp)
    if kind in ("k2", "mse"):
        return 0.5 * jnp.square(logp - ref_logp)
    # k3 / low_var_kl (Schulman): exp(d) - d - 1 with d = ref - logp, d clamped, value clamped.
    d = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -K3_CLAMP, K3_CLAMP)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "low_var_kl") -> jax.Array:
    """Per-token KL estimate between the policy and a reference: ``[N,T], [N,T] -> [N,T]``.

    Kinds (verl ``kl_penalty``), with x = logp - ref_logp:
      * ``"k1"`` / ``"kl"``: x
      * ``"k2"`` / ``"mse"``: x^2 / 2
      * ``"abs"``: |x|
      * ``"k3"`` / ``"low_var_kl"``: with d = clip(-x, -20, 20): exp(d) - d - 1, then clipped to
        [-10, 10] (so at most 10; the estimator itself is >= 0).
      * any of the above with a ``"+"`` suffix (e.g. ``"k3+"``): forward value of that estimator,
        gradient of k2 (straight-through), because k2's gradient is the unbiased KL gradient.

    Aggregate with ``agg_loss`` to get the KL loss. ``kind`` is static.
    """
    base, straight_through = _check_kl_kind(kind)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp has shape {ref_logp.shape}, expected {logp.shape}")
    forward = _kl_forward(logp, ref_logp, base)
    if not straight_through or base in ("k2", "mse"):
        return forward
    backward = 0.5 * jnp.square(logp - ref_logp)
    return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(forward)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Shannon entropy of softmax(logits) over the last axis: ``[N,T,V] -> [N,T]`` (any leading).

    ``H = logsumexp(z) - Σ_v softmax(z)_v · z_v``, computed in float32 (at least). Entries equal
    to ``-inf`` (masked vocabulary) contribute 0 and do not produce NaN.
    """
    z = logits.astype(jnp.result_type(logits.dtype, jnp.float32))
    lse = jax.nn.logsumexp(z, axis=-1)
    p = jax.nn.softmax(z, axis=-1)
    z_finite = jnp.where(jnp.isfinite(z), z, 0.0)
    return lse - jnp.sum(p * z_finite, axis=-1)


# --------------------------------------------------------------------------------------------
# combined loss
# --------------------------------------------------------------------------------------------


def grpo_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logp: jax.Array | None = None,
    kl_coef: float | jax.Array = 0.0,
    kl_kind: str = "low_var_kl",
    entropy: jax.Array | None = None,
    entropy_coef: float | jax.Array = 0.0,
    loss_agg_mode: str = "token-mean",
    norm_constant: float | jax.Array | None = None,
    num_tokens: float | jax.Array | None = None,
    num_seqs: float | jax.Array | None = None,
    **clip: float | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total GRPO/DAPO actor loss, as verl's actor composes it::

        total = pg_loss  - entropy_coef * agg(entropy)  + kl_coef * agg(kl_penalty(logp_new, ref))

    Every term uses the same ``loss_agg_mode`` (and denominators) over ``mask``.

    Args:
      logp_new, logp_old, advantages, mask, loss_agg_mode, norm_constant, num_tokens, num_seqs: as
        ``policy_loss``.
      clip: ``policy_loss``'s ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` (its defaults
        when not given).
      ref_logp: [N,T] reference-policy log-probs; the KL term is computed iff it is given.
      kl_coef, kl_kind: coefficient and ``kl_penalty`` kind (verl default ``low_var_kl``).
      entropy: [N,T] per-token entropy (e.g. ``entropy_from_logits(logits)``, computed by the
        caller so the [N,T,V] logits need not be passed around); term computed iff given.
      entropy_coef: entropy bonus coefficient.

    A non-zero static ``kl_coef`` without ``ref_logp`` (or ``entropy_coef`` without
    ``entropy``) raises ``ValueError``. Coefficients may be traced when their input is given.

    Returns ``(total, metrics)`` with the ``policy_loss`` metrics plus ``kl_loss`` / ``entropy``
    (aggregated, when computed) and ``total_loss``.
    """
    _check_kl_kind(kl_kind)
    if isinstance(kl_coef, (int, float)) and kl_coef != 0 and ref_logp is None:
        raise ValueError("kl_coef is non-zero but ref_logp was not given")
    if isinstance(entropy_coef, (int, float)) and entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef is non-zero but entropy was not given")
    agg_kw = dict(norm_constant=norm_constant, num_tokens=num_tokens, num_seqs=num_seqs)
    total, metrics = policy_loss(
        logp_new,
        logp_old,
        advantages,
        mask,
        loss_agg_mode=loss_agg_mode,
        **clip,
        **agg_kw,
    )
    if entropy is not None:
        _check_2d("entropy", entropy, logp_new.shape)
        ent = agg_loss(entropy.astype(total.dtype), mask, loss_agg_mode, **agg_kw)
        total = total - entropy_coef * ent
        metrics["entropy"] = ent
    if ref_logp is not None:
        _check_2d("ref_logp", ref_logp, logp_new.shape)
        valid = mask != 0  # zero masked positions first: no 0 * NaN in the backward pass
        lp = jnp.where(valid, logp_new.astype(total.dtype), 0.0)
        kl = kl_penalty(lp, jnp.where(valid, ref_logp.astype(total.dtype), 0.0), kl_kind)
        kl_loss = agg_loss(kl, mask, loss_agg_mode, **agg_kw)
        total = total + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    metrics["total_loss"] = total
    return total, metrics

