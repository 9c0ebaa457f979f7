"""GRPO / DAPO loss pieces against hand-computed values (plain Python math, float32 inputs)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm52_jax.rl import grpo

F32 = jnp.float32


def f32(x):
    return jnp.asarray(x, dtype=F32)


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b, dtype=np.float64), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------
# advantages
# ------------------------------------------------------------------------------------------


def test_advantages_pair_unbiased_std():
    # mean 0, unbiased std = sqrt(((-1)^2 + 1^2) / (2 - 1)) = sqrt(2)
    want = [-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)]
    close(grpo.group_advantages(f32([-1.0, 1.0]), group_size=2), want)
    close(grpo.group_advantages(f32([-1.0, 1.0]), jnp.array([7, 7])), want)
    close(want, [-0.7071063, 0.7071063])


def test_advantages_identical_rewards_are_zero():
    out = grpo.group_advantages(f32([1.0, 1.0, 1.0]), group_size=3)
    close(out, [0.0, 0.0, 0.0], atol=0)


def test_advantages_interleaved_groups():
    # group 0 at even slots: {1, 2, 6} mean 3, deviations (-2, -1, 3), ss 14, var 7
    # group 1 at odd slots: {0, 4, 2} mean 2, deviations (-2, 2, 0), ss 8, var 4
    r = f32([1.0, 0.0, 2.0, 4.0, 6.0, 2.0])
    ids = jnp.array([0, 1, 0, 1, 0, 1])
    s0, s1 = math.sqrt(7.0) + 1e-6, 2.0 + 1e-6
    want = [-2 / s0, -2 / s1, -1 / s0, 2 / s1, 3 / s0, 0.0]
    close(grpo.group_advantages(r, ids), want)
    # Dr.GRPO: mean-centering only
    close(grpo.group_advantages(r, ids, norm_by_std=False), [-2, -2, -1, 2, 3, 0])


def test_advantages_group_size_matches_ids():
    r = f32([0.5, -1.0, 1.0, 1.0, 1.0, -1.0, 3.0, 0.0])
    by_size = grpo.group_advantages(r, group_size=4)
    by_ids = grpo.group_advantages(r, jnp.array([0, 0, 0, 0, 5, 5, 5, 5]))
    close(by_size, by_ids)
    # group 1 {1, -1, 3, 0}: mean 0.75, dev (0.25, -1.75, 2.25, -0.75), ss 8.75, var 8.75/3
    s = math.sqrt(8.75 / 3) + 1e-6
    close(by_size[4:], [0.25 / s, -1.75 / s, 2.25 / s, -0.75 / s])


def test_advantages_singleton_follows_verl():
    # verl: singleton group -> mean 0, std 1, so A = r / (1 + eps) (not 0).
    r = f32([2.0, -1.0, 1.0])
    ids = jnp.array([3, 1, 1])
    s2 = math.sqrt(2) + 1e-6
    close(grpo.group_advantages(r, ids), [2.0 / (1 + 1e-6), -1 / s2, 1 / s2])
    close(grpo.group_advantages(r, ids, norm_by_std=False), [2.0, -1.0, 1.0])
    close(grpo.group_advantages(r, group_size=1), [2 / (1 + 1e-6), -1 / (1 + 1e-6), 1 / (1 + 1e-6)])


def test_advantages_validation():
    with pytest.raises(ValueError, match="group_size"):
        grpo.group_advantages(f32([1.0, 2.0, 3.0]), group_size=2)
    with pytest.raises(ValueError, match="exactly one"):
        grpo.group_advantages(f32([1.0, 2.0]))
    with pytest.raises(ValueError, match="group_ids"):
        grpo.group_advantages(f32([1.0, 2.0]), jnp.array([0, 0, 0]))


# ------------------------------------------------------------------------------------------
# policy loss
# ------------------------------------------------------------------------------------------


def _pl(logp_new, logp_old, adv, mask, **kw):
    return grpo.policy_loss(f32(logp_new), f32(logp_old), f32(adv), f32(mask), **kw)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    lp = [[-1.0, -2.0], [-0.5, -3.0]]
    loss, m = _pl(lp, lp, [0.5, -1.5], [[1, 1], [1, 1]])
    close(loss, -(0.5 + 0.5 - 1.5 - 1.5) / 4)
    close(m["clipfrac"], 0.0)
    close(m["clipfrac_lower"], 0.0)
    close(m["approx_kl"], 0.0)


def test_policy_loss_upper_clip():
    # A = 1, ratio 1.5 > 1 + 0.28: loss = max(-1.5, -1.28) = -1.28
    loss, m = _pl([[math.log(1.5)]], [[0.0]], [1.0], [[1.0]])
    close(loss, -1.28)
    close(m["clipfrac"], 1.0)
    close(m["approx_kl"], -math.log(1.5))
    # ratio 0.5 with A > 0 is not clipped (pessimistic branch is the unclipped one)
    loss, m = _pl([[math.log(0.5)]], [[0.0]], [1.0], [[1.0]])
    close(loss, -0.5)
    close(m["clipfrac"], 0.0)


def test_policy_loss_lower_clip():
    # A = -1, ratio 0.5 < 1 - 0.2: loss = max(0.5, 0.8) = 0.8 (dual clip inactive: 0.8 < 3)
    loss, m = _pl([[math.log(0.5)]], [[0.0]], [-1.0], [[1.0]])
    close(loss, 0.8)
    close(m["clipfrac"], 1.0)
    close(m["clipfrac_lower"], 0.0)


def test_policy_loss_dual_clip():
    # A = -2, ratio 5: standard loss max(10, 2.4) = 10, dual clip caps it at -A*c = 6
    loss, m = _pl([[math.log(5.0)]], [[0.0]], [-2.0], [[1.0]], clip_ratio_c=3.0)
    close(loss, 6.0)
    close(m["clipfrac_lower"], 1.0)
    close(m["clipfrac"], 0.0)
    loss, m = _pl([[math.log(5.0)]], [[0.0]], [-2.0], [[1.0]], clip_ratio_c=None)
    close(loss, 10.0)
    close(m["clipfrac_lower"], 0.0)
    # dual clip never touches A > 0: A = 2, ratio 5 -> upper clip -2 * 1.28
    loss, _ = _pl([[math.log(5.0)]], [[0.0]], [2.0], [[1.0]], clip_ratio_c=3.0)
    close(loss, -2.56)


def test_policy_loss_masked_tokens_ignored():
    # second token is masked and holds garbage (huge ratio, NaN old logp must not leak)
    new = f32([[0.0, 50.0, 0.0]])
    old = f32([[0.0, jnp.nan, 0.0]])
    mask = f32([[1, 0, 1]])
    loss, m = grpo.policy_loss(new, old, f32([[1.0, 1.0, 3.0]]), mask)
    close(loss, -(1.0 + 3.0) / 2)
    close(m["approx_kl"], 0.0)
    g = jax.grad(lambda x: grpo.policy_loss(x, old, f32([[1.0, 1.0, 3.0]]), mask)[0])(new)
    close(g, [[-0.5, 0.0, -1.5]])


def test_policy_loss_log_ratio_clamped_at_20():
    # log-ratio 30 is clamped to 20 before exp; A = -1 and no dual clip -> loss = exp(20)
    loss, m = _pl([[30.0]], [[0.0]], [-1.0], [[1.0]], clip_ratio_c=None)
    close(loss, math.exp(20.0), rtol=1e-5)
    close(m["approx_kl"], -20.0)
    loss, m = _pl([[0.0]], [[30.0]], [1.0], [[1.0]])
    close(loss, -math.exp(-20.0), rtol=1e-5, atol=0)
    close(m["approx_kl"], 20.0)


def test_policy_loss_advantage_token_form_equals_seq_form():
    new = f32([[-1.0, -0.2, -0.7], [-0.1, -2.0, -0.3]])
    old = f32([[-1.1, -0.1, -0.7], [-0.4, -1.0, -0.3]])
    mask = f32([[1, 1, 0], [1, 1, 1]])
    a = f32([0.7, -1.2])
    l1, _ = grpo.policy_loss(new, old, a, mask)
    l2, _ = grpo.policy_loss(new, old, a[:, None] * mask, mask)
    close(l1, l2)


def test_policy_loss_validation():
    x = f32([[0.0]])
    for kw, name in [
        (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
        (dict(clip_ratio_high=-0.1), "clip_ratio_high"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(loss_agg_mode="seq-sum"), "loss_agg_mode"),
    ]:
        with pytest.raises(ValueError, match=name):
            grpo.policy_loss(x, x, f32([1.0]), x, **kw)
    with pytest.raises(ValueError, match="advantages"):
        grpo.policy_loss(x, x, f32([1.0, 2.0]), x)


# ------------------------------------------------------------------------------------------
# aggregation
# ------------------------------------------------------------------------------------------

L23 = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
M23 = [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(
    "mode, want",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),  # 5
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # 3
        ("seq-mean-token-sum-norm", (1 + 2 + 3 + 4) / 3),  # T = 3
    ],
)
def test_agg_modes(mode, want):
    close(grpo.agg_loss(f32(L23), f32(M23), mode), want)
    close(grpo.agg_loss(f32(L23), jnp.asarray(M23, bool), mode), want)


def test_agg_norm_constant_and_overrides():
    close(grpo.agg_loss(f32(L23), f32(M23), "seq-mean-token-sum-norm", norm_constant=8.0), 10 / 8)
    close(grpo.agg_loss(f32(L23), f32(M23), "token-mean", num_tokens=20.0), 10 / 20)
    close(grpo.agg_loss(f32(L23), f32(M23), "seq-mean-token-sum", num_seqs=4.0), 10 / 4)


def test_agg_excludes_empty_sequences_and_masked_nan():
    loss = f32([[1.0, jnp.nan], [jnp.inf, 7.0], [3.0, 5.0]])
    mask = f32([[1, 0], [0, 0], [1, 1]])  # middle sequence fully masked
    close(grpo.agg_loss(loss, mask, "token-mean"), 9 / 3)
    close(grpo.agg_loss(loss, mask, "seq-mean-token-sum"), (1 + 8) / 2)
    close(grpo.agg_loss(loss, mask, "seq-mean-token-mean"), (1 + 4) / 2)
    close(grpo.agg_loss(loss, mask, "seq-mean-token-sum-norm"), 9 / 2)


def test_agg_all_masked_is_zero_not_nan():
    z = f32([[1.0, 2.0]])
    m = f32([[0, 0]])
    for mode in grpo.LOSS_AGG_MODES:
        close(grpo.agg_loss(z, m, mode), 0.0, atol=0)


def test_agg_unknown_mode_lists_allowed():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        grpo.agg_loss(f32(L23), f32(M23), "token-sum")


# ------------------------------------------------------------------------------------------
# KL and entropy
# ------------------------------------------------------------------------------------------


def test_kl_k1_k3_values():
    logp = f32([[math.log(0.5), -30.0, 0.0]])
    ref = f32([[math.log(0.25), 0.0, -30.0]])
    close(grpo.kl_penalty(logp, ref, "k1"), [[math.log(2.0), -30.0, 30.0]])
    # k3: d = ref - logp; exp(d) - d - 1; d clamped to [-20, 20], value clamped to <= 10
    d = -math.log(2.0)
    want0 = math.exp(d) - d - 1  # 0.5 + ln 2 - 1 = 0.19315
    close(want0, 0.1931471805599453)
    for kind in ("k3", "low_var_kl"):
        close(grpo.kl_penalty(logp, ref, kind), [[want0, 10.0, 10.0]])
    close(grpo.kl_penalty(logp, ref, "k2")[0, 0], 0.5 * math.log(2.0) ** 2)
    with pytest.raises(ValueError, match="kind"):
        grpo.kl_penalty(logp, ref, "k4")


def test_kl_straight_through_gradient():
    logp = f32([[-0.3, -1.0]])
    ref = f32([[-0.5, -0.2]])
    fwd = grpo.kl_penalty(logp, ref, "k3+")
    close(fwd, grpo.kl_penalty(logp, ref, "k3"))
    g = jax.grad(lambda x: grpo.kl_penalty(x, ref, "k3+").sum())(logp)
    close(g, [[-0.3 + 0.5, -1.0 + 0.2]])  # d/dx 0.5 (x - ref)^2


def test_entropy_uniform_and_masked_vocab():
    v = 7
    close(grpo.entropy_from_logits(jnp.full((2, 3, v), 0.3, F32)), np.full((2, 3), math.log(v)))
    logits = f32([[[0.0, 0.0, -jnp.inf, 0.0]]])
    close(grpo.entropy_from_logits(logits), [[math.log(3.0)]])
    # two-point distribution p = (0.8, 0.2)
    p = [0.8, 0.2]
    logits = f32([[[math.log(p[0]), math.log(p[1])]]])
    close(grpo.entropy_from_logits(logits), [[-(0.8 * math.log(0.8) + 0.2 * math.log(0.2))]])
    g = jax.grad(lambda z: grpo.entropy_from_logits(z).sum())(f32([[[0.0, 0.0, -jnp.inf]]]))
    assert np.all(np.isfinite(np.asarray(g)[..., :2]))


# ------------------------------------------------------------------------------------------
# gradients, combined loss, jit
# ------------------------------------------------------------------------------------------


def test_grad_at_ratio_one_is_policy_gradient():
    lp = f32([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    mask = f32([[1, 1, 0], [1, 1, 1]])
    a = f32([0.6, -1.4])
    g = jax.grad(lambda x: grpo.policy_loss(x, lp, a, mask)[0])(lp)
    want = -np.array([[0.6], [-1.4]]) * np.array([[1, 1, 0], [1, 1, 1]]) / 5
    close(g, want)


def test_clipped_tokens_get_zero_gradient():
    # tokens: upper-clipped (A>0, r=1.5), lower-clipped (A<0, r=0.5), dual-clipped (A<0, r=5),
    # unclipped (A>0, r=1.1)
    old = f32([[0.0, 0.0, 0.0, 0.0]])
    new = f32([[math.log(1.5), math.log(0.5), math.log(5.0), math.log(1.1)]])
    adv = f32([[1.0, -1.0, -1.0, 2.0]])
    mask = f32([[1, 1, 1, 1]])
    g = jax.grad(lambda x: grpo.policy_loss(x, old, adv, mask)[0])(new)
    # unclipped token: d/dx (-A e^x) / 4 = -2 * 1.1 / 4
    close(g, [[0.0, 0.0, 0.0, -2 * 1.1 / 4]])


def test_grpo_loss_combines_terms():
    new = f32([[math.log(0.5), math.log(0.25)], [0.0, -1.0]])
    old = new
    ref = f32([[math.log(0.25), math.log(0.25)], [0.0, -1.0]])
    mask = f32([[1, 1], [1, 0]])
    ent = f32([[1.0, 2.0], [3.0, 100.0]])
    a = f32([1.0, -0.5])
    total, m = grpo.grpo_loss(
        new, old, a, mask, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01
    )
    pg = -(1.0 + 1.0 - 0.5) / 3
    k3 = 0.5 + math.log(2.0) - 1.0  # only the first token differs from ref
    want = pg - 0.01 * (1 + 2 + 3) / 3 + 0.1 * k3 / 3
    close(m["pg_loss"], pg)
    close(m["kl_loss"], k3 / 3)
    close(m["entropy"], 2.0)
    close(total, want)
    close(m["total_loss"], want)
    plain, m2 = grpo.grpo_loss(new, old, a, mask)
    close(plain, pg)
    assert "kl_loss" not in m2 and "entropy" not in m2
    with pytest.raises(ValueError, match="ref_logp"):
        grpo.grpo_loss(new, old, a, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        grpo.grpo_loss(new, old, a, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="kind"):
        grpo.grpo_loss(new, old, a, mask, kl_kind="bogus")


def test_grpo_loss_masked_garbage_gives_finite_grad():
    # masked positions hold inf / NaN in every input; loss and gradient must stay finite
    new = f32([[-0.5, jnp.inf], [-1.0, -0.2]])
    old = f32([[-0.4, jnp.nan], [-1.0, -jnp.inf]])
    ref = f32([[-0.6, jnp.nan], [-0.9, -jnp.inf]])
    ent = f32([[1.0, jnp.nan], [0.5, jnp.nan]])
    mask = f32([[1, 0], [1, 0]])

    def fn(x):
        return grpo.grpo_loss(
            x, old, f32([1.0, -1.0]), mask,
            ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01,
        )[0]

    val, g = jax.value_and_grad(fn)(new)
    assert np.isfinite(float(val))
    assert np.all(np.isfinite(np.asarray(g)))
    close(np.asarray(g)[:, 1], [0.0, 0.0], atol=0)


def test_jit_and_grad_under_jit():
    new = f32([[math.log(1.5), -0.2, 0.0], [math.log(5.0), 0.1, -0.4]])
    old = f32([[0.0, -0.2, 0.0], [0.0, 0.0, 0.0]])
    mask = f32([[1, 1, 0], [1, 1, 1]])
    rewards = f32([1.0, -1.0])

    @jax.jit
    def step(new, old, rewards, mask, ref):
        adv = grpo.group_advantages(rewards, group_size=2)
        return jax.value_and_grad(
            lambda x: grpo.grpo_loss(
                x, old, adv, mask, ref_logp=ref, kl_coef=0.01, loss_agg_mode="seq-mean-token-mean"
            ),
            has_aux=True,
        )(new)

    (loss, metrics), g = step(new, old, rewards, mask, old)
    (loss_e, _), g_e = jax.value_and_grad(
        lambda x: grpo.grpo_loss(
            x,
            old,
            grpo.group_advantages(rewards, group_size=2),
            mask,
            ref_logp=old,
            kl_coef=0.01,
            loss_agg_mode="seq-mean-token-mean",
        ),
        has_aux=True,
    )(new)
    close(loss, loss_e)
    close(g, g_e)
    assert loss.dtype == F32 and g.dtype == F32
    assert all(np.isfinite(np.asarray(v)) for v in metrics.values())
    # group ids may be traced too
    out = jax.jit(grpo.group_advantages)(f32([-1.0, 1.0]), jnp.array([4, 4]))
    close(out, [-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)])
