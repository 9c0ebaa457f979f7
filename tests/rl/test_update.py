"""One GRPO update: LoRA-only AdamW step; a non-finite gradient aborts it with nothing changed."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from lora_utils import fast_rngs

import glm52_jax
from glm52_jax import config
from glm52_jax.model.lora import FAMILIES, LoRA, LoRAConfig
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.rl.update import AdamWConfig, LoRAOptimizer, NonFiniteGradientError, grpo_update

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0))
# Dense + full indexer, then MoE + shared indexer (every LoRA family). Model, options and batch shapes are
# those of tests/parallel/multiprocess_worker.training_problem, whose one-device reference step compiles
# the same shared_prefix gradient program: one compile serves both files.
CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
P, G, R = 45, 2, 6
ADAMW = AdamWConfig(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def fresh():
    """A freshly initialised LoRA model (B = 0); tests take clones, since updates mutate."""
    return GlmMoeDsa(CFG, OPTS, rngs=fast_rngs())


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    mask = np.ones((G, R), np.float32)
    mask[0, 3:] = 0
    return dict(prompt=rng.integers(0, 512, P).astype(np.int32),
                responses=rng.integers(0, 512, (G, R)).astype(np.int32), response_mask=mask,
                old_logprobs=rng.normal(-6.3, 0.2, (G, R)).astype(np.float32),
                advantages=np.array([0.7, -0.7], np.float32))


def _bytes(tree) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def _flat(model, kind):
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, kind))}


def test_one_step_trains_lora_only(fresh, batch):
    model = nnx.clone(fresh)
    optimizer = LoRAOptimizer(model, ADAMW)
    base_before, lora_before = _bytes(nnx.state(model, nnx.Param)), _flat(model, LoRA)
    result = grpo_update(model, optimizer, **batch, mode="shared_prefix")
    assert np.isfinite(float(result.loss)) and float(result.grad_norm) > 0
    assert result.step == optimizer.step == 1
    counts = [c for c in jax.tree.leaves(optimizer.opt_state) if np.asarray(c).dtype == np.int32]
    assert counts and all(int(c) == 1 for c in counts)  # optax's Adam step count
    assert _bytes(nnx.state(model, nnx.Param)) == base_before  # the base never changes
    families = {p: v.get_metadata()["family"] for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    moved = set()
    for path, after in _flat(model, LoRA).items():
        if path[-1] in ("b", "b_k", "b_v"):
            assert np.abs(after).max() > 0, path  # every B left zero
            moved.add(families[path])
    assert moved == set(FAMILIES)
    # A's gradient is zero while B = 0: only weight decay moves it, by lr * wd * A.
    a_path = ("lm_head_lora", "a")
    np.testing.assert_allclose(_flat(model, LoRA)[a_path], lora_before[a_path] * (1 - 1e-3 * 0.01), rtol=1e-6)


def test_the_step_is_one_program_with_the_clipped_adamw_step(fresh, batch):
    """`grpo_update` runs one program, `grpo_step` (the one plan mode's train program compiles); the model and the
    optimizer take exactly its outputs: its gradient norm, and every adapter after the step equal to AdamW's first
    step written out in numpy from the gradients it returns (clip to max_grad_norm, m = (1-b1) g, v = (1-b2) g^2,
    bias-corrected, decoupled weight decay). No other program is compiled."""
    from glm52_jax.plan import programs

    assert "update.grpo_step(" in inspect.getsource(programs.train_program)
    model = nnx.clone(fresh)
    optimizer = LoRAOptimizer(model, ADAMW)
    before = _flat(model, LoRA)
    result = grpo_update(model, optimizer, **batch, mode="shared_prefix")
    grads = {path: np.asarray(v.get_value(), np.float64) for path, v in nnx.to_flat_state(result.grads)}
    assert grads.keys() == before.keys() and all(np.isfinite(g).all() for g in grads.values())
    norm = np.sqrt(sum((g ** 2).sum() for g in grads.values()))
    np.testing.assert_allclose(float(result.grad_norm), norm, rtol=1e-5)
    scale = min(1.0, ADAMW.max_grad_norm / norm)
    b1, b2, eps, lr, wd = ADAMW.b1, ADAMW.b2, ADAMW.eps, ADAMW.learning_rate, ADAMW.weight_decay
    for path, after in _flat(model, LoRA).items():
        g = grads[path] * scale
        m_hat, v_hat = (1 - b1) * g / (1 - b1), (1 - b2) * g ** 2 / (1 - b2)
        expect = before[path] - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * before[path])
        np.testing.assert_allclose(after, expect, rtol=1e-5, atol=1e-8, err_msg=str(path))
    moments = [np.asarray(x) for x in jax.tree.leaves(optimizer.opt_state) if np.asarray(x).dtype == np.float32]
    assert sum(x.size for x in moments) == 2 * sum(g.size for g in grads.values())  # mu and nu of every adapter


def test_one_step_on_an_fp8_base_trains_lora_only(fresh, batch):
    """The same step on the base quantized as `model.base_weights="fp8"` does it (e4m3 + 128 x 128 block scales
    on every projection): every family's B moves, and the base (values and scales) and the inventory the
    transaction takes of it stay bit for bit (tests/rl/test_policy.py runs the embedded policy, marked slow)."""
    from glm52_jax.checkpoint.hf import quantize_model
    from glm52_jax.checkpoint.hf_fp8 import RELEASE
    from glm52_jax.checkpoint.inventory import changed_entries, param_inventory
    from glm52_jax.model.fp8 import Fp8Weight

    model = quantize_model(nnx.clone(fresh), RELEASE)
    base = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert sum(isinstance(v, Fp8Weight) for v in base) == 11 + 12  # tests/plan/test_plan.py's count, same layers
    optimizer = LoRAOptimizer(model, ADAMW)
    base_before, inventory_before = _bytes(nnx.state(model, nnx.Param)), param_inventory(model)
    result = grpo_update(model, optimizer, **batch, mode="shared_prefix")
    assert np.isfinite(float(result.loss)) and float(result.grad_norm) > 0
    assert _bytes(nnx.state(model, nnx.Param)) == base_before
    changed = changed_entries(inventory_before, param_inventory(model))
    assert changed and all("_lora/" in name for name in changed), changed
    families = {p: v.get_metadata()["family"] for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    assert {families[p] for p, after in _flat(model, LoRA).items()
            if p[-1] in ("b", "b_k", "b_v") and np.abs(after).max() > 0} == set(FAMILIES)


def test_transform_clips_by_global_norm_then_adamw():
    grads = {"a": jnp.asarray([3.0, 4.0]), "b": jnp.asarray([0.0])}  # global norm 5
    params = {"a": jnp.asarray([1.0, -1.0]), "b": jnp.asarray([2.0])}
    cfg = AdamWConfig(learning_rate=0.1, eps=1.0, weight_decay=0.5, max_grad_norm=1.0)  # eps=1: not scale-free
    tx = cfg.transform()
    updates, _ = tx.update(grads, tx.init(params), params)
    ref_tx = optax.adamw(0.1, b1=cfg.b1, b2=cfg.b2, eps=1.0, weight_decay=0.5)
    scaled = jax.tree.map(lambda g: g / 5.0, grads)
    expect, _ = ref_tx.update(scaled, ref_tx.init(params), params)
    for k in grads:
        np.testing.assert_allclose(np.asarray(updates[k]), np.asarray(expect[k]), rtol=1e-6)


@pytest.mark.parametrize("poison", ["advantage", "old_logprob"])
def test_non_finite_gradient_aborts_with_nothing_changed(fresh, batch, poison):
    model = nnx.clone(fresh)
    optimizer = LoRAOptimizer(model, ADAMW)
    bad = dict(batch)
    if poison == "advantage":
        bad["advantages"] = np.array([np.nan, -0.7], np.float32)
    else:
        old = batch["old_logprobs"].copy()
        old[1, 0] = np.nan
        bad["old_logprobs"] = old
    params_before, opt_before = _bytes(nnx.state(model)), _bytes(optimizer.opt_state)
    with pytest.raises(NonFiniteGradientError, match=r"LoRA parameter \S+lora/"):
        grpo_update(model, optimizer, **bad, mode="shared_prefix")
    assert optimizer.step == 0
    assert _bytes(nnx.state(model)) == params_before
    assert _bytes(optimizer.opt_state) == opt_before


def test_optimizer_needs_lora():
    base = nnx.eval_shape(lambda: GlmMoeDsa(CFG, glm52_jax.ModelOptions(param_dtype=jnp.float32), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="no LoRA"):
        LoRAOptimizer(base)
