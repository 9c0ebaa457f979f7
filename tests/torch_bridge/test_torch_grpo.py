"""The torch GRPO policy loss (`torch_bridge/grpo.py`) equals our JAX `rl.grpo.policy_loss`, value and
gradient, for every aggregation mode, on random inputs where tokens clip low, high and by the dual clip.

Both sides run in float64 so that the comparison tests the formulas, not rounding: in float32 the losses of
this fixture differ by up to 1.8e-6 relative (seq-mean-token-sum, a sum of terms of both signs), and each
float32 loss is within 1.1e-6 of the float64 one, torch's and ours alike (measured 2026-12-05).
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from glm52_jax.rl import grpo as jax_grpo  # noqa: E402
from glm52_jax.rl.gradients import LossSettings  # noqa: E402
from glm52_jax.torch_bridge import grpo  # noqa: E402

G, R = 4, 7
REL = 1e-12  # float64 on both sides


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    logp = rng.normal(-2.0, 0.5, (G, R))
    old = logp - rng.normal(0.0, 0.6, (G, R))  # log-ratios of about +-1: every clip occurs
    old[0, :3] = logp[0, :3] - np.array([0.5, -0.5, 0.05])  # A > 0: high clip, below, inside
    old[1, :3] = logp[1, :3] - np.array([-0.5, 1.5, 0.05])  # A < 0: low clip, dual clip, inside
    mask = np.ones((G, R))
    mask[2, 5:] = 0  # a masked tail ...
    old[2, 5:] = np.nan  # ... whose padding must not reach the loss or its gradient
    mask[3, :] = 0  # a fully masked sequence (excluded from the seq-mean denominators)
    adv = np.array([1.0, -0.7, 0.4, -1.2])
    return logp, old, adv, mask


def _clip_counts(logp, old, adv, mask, s: LossSettings) -> dict[str, int]:
    ratio = np.exp(np.where(mask != 0, logp - old, 0.0))
    a = adv[:, None] * (mask != 0)
    return {"high": int(((a > 0) & (ratio > 1 + s.clip_ratio_high)).sum()),
            "low": int(((a < 0) & (ratio < 1 - s.clip_ratio_low)).sum()),
            "dual": int(((a < 0) & (ratio > s.clip_ratio_c)).sum())}


@pytest.mark.parametrize("mode,norm_constant", [("token-mean", None), ("seq-mean-token-sum", None),
                                                ("seq-mean-token-mean", None), ("seq-mean-token-sum-norm", None),
                                                ("seq-mean-token-sum-norm", 16.0)])
def test_loss_and_gradient_equal_jax(inputs, mode, norm_constant):
    logp, old, adv, mask = inputs
    settings = LossSettings(loss_agg_mode=mode, norm_constant=norm_constant)
    counts = _clip_counts(logp, old, adv, mask, settings)
    assert min(counts.values()) >= 1, counts  # the fixture exercises every clip

    def jax_loss(lp):
        return jax_grpo.policy_loss(lp, old, adv, mask, clip_ratio_low=settings.clip_ratio_low,
                                    clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c,
                                    loss_agg_mode=mode, norm_constant=norm_constant)[0]

    with jax.enable_x64(True):
        want, want_grad = jax.value_and_grad(jax_loss)(logp)
    assert want.dtype == np.float64
    lp = torch.tensor(logp, requires_grad=True)
    got = grpo.policy_loss(lp, torch.as_tensor(old), torch.as_tensor(adv), torch.as_tensor(mask), settings)
    got.backward()
    assert np.isfinite(got.item()) and np.isfinite(lp.grad.numpy()).all()
    np.testing.assert_allclose(got.item(), float(want), rtol=REL, atol=0)
    np.testing.assert_allclose(lp.grad.numpy(), np.asarray(want_grad), rtol=REL, atol=1e-15)
    assert np.all(lp.grad.numpy()[mask == 0] == 0)
    assert np.abs(np.asarray(want_grad)).max() > 0.01  # the gradient is not trivially zero


def test_no_dual_clip_and_empty_batch():
    logp = np.full((2, 3), -1.0, np.float32)
    old = logp - 1.5  # ratio e^1.5 > 3
    adv = np.array([-1.0, 1.0], np.float32)
    no_dual = LossSettings(clip_ratio_c=None)
    got = grpo.policy_loss(torch.as_tensor(logp), torch.as_tensor(old), torch.as_tensor(adv),
                           torch.ones(2, 3), no_dual).item()
    # A = -1 tokens: max(e^1.5, 1.28) each; A = +1 tokens: max(-e^1.5, -1.28) = -1.28 each
    np.testing.assert_allclose(got, (np.exp(np.float32(1.5)) - 1.28) / 2, rtol=1e-6)  # float32
    empty = grpo.policy_loss(torch.as_tensor(logp), torch.as_tensor(old), torch.as_tensor(adv),
                             torch.zeros(2, 3), LossSettings())
    assert empty.item() == 0.0  # verl divides by zero here; ours (JAX and torch) returns 0
