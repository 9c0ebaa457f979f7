"""Feed-forward blocks: dense SwiGLU MLP and the sigmoid-routed MoE with a shared expert.

Routing (HF `GlmMoeDsaTopkRouter`), in float32: scores = sigmoid(x W_r); selection uses
scores + e_score_correction_bias, limited to the `topk_group` groups whose top-2 biased scores sum
highest; the combine weights are the unbiased scores of the chosen experts, optionally normalised
(`norm_topk_prob`), times `routed_scaling_factor`.

Experts run dropless: token-expert pairs are sorted by expert and fed to `lax.ragged_dot`, so
memory is `O(tokens * top_k * D)` whatever the routing.

Axis letters: T tokens, D model, I expert intermediate, E experts, G groups, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax.config import ModelConfig
from glm52_jax.model.layers import param, project
from glm52_jax.model.options import ModelOptions
from glm52_jax.parallel.rules import constrain


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = param(rngs, (hidden, intermediate), ("embed", "mlp"), dtype)
        self.up_proj = param(rngs, (hidden, intermediate), ("embed", "mlp"), dtype)
        self.down_proj = param(rngs, (intermediate, hidden), ("mlp", "embed"), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(project(x, self.gate_proj, "...d,di->...i")) * project(x, self.up_proj, "...d,di->...i")
        return project(h, self.down_proj, "...i,id->...d")


def route(cfg: ModelConfig, x: jax.Array, router: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x: [T,D] -> (weights [T,K] float32, experts [T,K] int32)`."""
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), router, preferred_element_type=jnp.float32)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    groups = cfg.n_group
    if groups > 1:
        grouped = choice.reshape(-1, groups, cfg.n_routed_experts // groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T,G]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(group_scores.shape[0])[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, cfg.n_routed_experts // groups, axis=-1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)


def experts_ragged(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array) -> jax.Array:
    """Dropless routed experts: `x: [T,D], weights/experts: [T,K]`, `w_*: [E,D,I] / [E,I,D]` -> [T,D]."""
    tokens, k = experts.shape
    num_experts = w_gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = x[token_of].astype(w_gate.dtype)
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up).astype(w_down.dtype)
    y = jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(y)


class MoE(nnx.Module):
    """Routed experts + shared expert (HF `GlmMoeDsaMoE`)."""

    def __init__(self, cfg: ModelConfig, opts: ModelOptions, rngs: nnx.Rngs):
        dt = opts.param_dtype
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router = param(rngs, (d, e), ("embed", None), jnp.float32)
        self.e_score_correction_bias = param(None, (e,), (None,), jnp.float32, init="zeros")
        self.w_gate = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), dt)
        self.w_up = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), dt)
        self.w_down = param(rngs, (e, i, d), ("experts", "expert_mlp", "embed"), dt)
        self.shared_experts = MLP(d, i * cfg.n_shared_experts, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B,S,D] -> [B,S,D]`."""
        batch, seq, d = x.shape
        flat = x.reshape(-1, d)
        weights, experts = route(self.cfg, flat, self.router[...], self.e_score_correction_bias[...])
        routed = experts_ragged(flat, weights, experts, self.w_gate[...], self.w_up[...], self.w_down[...])
        routed = routed.astype(x.dtype).reshape(batch, seq, d)
        return constrain(routed + self.shared_experts(x), ("batch", "seq", "embed"))
