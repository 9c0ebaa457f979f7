"""The torch references' shared test model and rollout fixture (tests/torch_bridge/test_torch_gradients.py,
test_megatron_reference.py).

The model has random base weights and random nonzero LoRA A and B in every family (B = 0 would make every
A-gradient zero), built from numpy values without an XLA compile (as tests/checkpoint/test_peft.py does).
index_topk is 16 < P - 1 + R, so the DSA indexer really selects; its weights are drawn wide, so no two
index scores tie (HF's `torch.topk` breaks ties otherwise than ours: tests/benchmarks/test_topk_ties.py).
The fixture has a masked tail, advantages of both signs and old log-probs set so that tokens clip high,
low and by the dual clip.

Axis letters: P prompt tokens, G responses, R response tokens.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm52_jax import config
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.rl.gradients import LossSettings, lora_gradients

# 4 layers: dense + full indexer, MoE + full, then 2 x (MoE + shared indexer) stacked in one scan (a real
# leading layers axis); index_topk 16 below the 29 positions of a sequence.
CFG = config.tiny(num_hidden_layers=4, indexer_types=("full", "full", "shared", "shared"), index_topk=16)
LORA = LoRAConfig(rank=3, alpha=6.0)  # rank 3 differs from every model dim; scale 2 shows a lost scale
OPTS = ModelOptions(param_dtype=jnp.float32, lora=LORA)
P, G, R = 24, 2, 6
MODES = ("conventional", "response_only")
LOSS = LossSettings()  # DAPO: clip 0.2 / 0.28, dual clip 3, token-mean
# Per-token log-ratios log(new / old) the fixture sets. Sample 0 (A > 0): high clip (e^0.5 > 1.28), then
# inside; sample 1 (A < 0): low clip (e^-0.5 < 0.8), dual clip (e^1.5 > 3), inside, then 2 masked tokens.
LOG_RATIOS = np.array([[0.5, -0.15, 0.1, -0.1, 0.05, 0.2], [-0.5, 1.5, 0.1, -0.05, 0.0, 0.0]], np.float32)


def _value(path, shape, rng) -> np.ndarray:
    name = path[-1]
    if name == "weight":  # norms
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name in ("bias", "e_score_correction_bias"):
        return 0.1 * rng.standard_normal(shape)
    if name in ("a", "b", "b_k", "b_v"):  # every adapter's delta nonzero
        return 0.1 * rng.standard_normal(shape)
    return 0.08 * rng.standard_normal(shape)


def random_model(seed: int) -> GlmMoeDsa:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(CFG, OPTS, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    flat = [(p, v.replace(jnp.asarray(_value(p, v.get_value().shape, rng), v.get_value().dtype)))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def family_vectors(grads: nnx.State, model) -> dict[str, np.ndarray]:
    """Gradient leaves flattened (float64) per LoRA family, plus "all"."""
    family = {p: v.get_metadata()["family"] for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    parts = {}
    for path, g in nnx.to_flat_state(grads):
        parts.setdefault(family[path], []).append(np.asarray(g.get_value(), np.float64).ravel())
    vecs = {f: np.concatenate(v) for f, v in parts.items()}
    vecs["all"] = np.concatenate(list(vecs.values()))
    return vecs


def compare(a: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per family: cosine and relative L2 |a - ref| / |ref|."""
    return {f: {"cosine": float(a[f] @ r / (np.linalg.norm(a[f]) * np.linalg.norm(r))),
                "rel_l2": float(np.linalg.norm(a[f] - r) / np.linalg.norm(r))} for f, r in ref.items()}


def make_fixture(model) -> dict:
    """The rollout fixture: prompt [P], responses [G,R], mask, old log-probs, advantages [G]."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, CFG.vocab_size, P).astype(np.int32)
    responses = rng.integers(0, CFG.vocab_size, (G, R)).astype(np.int32)
    mask = np.ones((G, R), np.float32)
    mask[1, 4:] = 0  # sample 1 stopped early
    advantages = np.array([1.0, -0.7], np.float32)
    # The new log-probs (they do not depend on the old ones), then old = new - LOG_RATIOS.
    new = lora_gradients(model, prompt, responses, mask, np.zeros((G, R), np.float32), advantages,
                         mode="conventional", loss=LOSS).logprobs
    old = np.asarray(new) - LOG_RATIOS
    old[mask == 0] = 0.0
    return dict(prompt=prompt, responses=responses, mask=mask, old_logprobs=old, advantages=advantages)
