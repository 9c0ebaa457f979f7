"""Feed-forward blocks: dense SwiGLU MLP and the sigmoid-routed MoE with a shared expert.

Routing (HF `GlmMoeDsaTopkRouter`), in float32: scores = sigmoid(x W_r); selection uses
scores + e_score_correction_bias, limited to the `topk_group` groups whose top-2 biased scores sum
highest; the combine weights are the unbiased scores of the chosen experts, optionally normalised
(`norm_topk_prob`), times `routed_scaling_factor`.

Experts run dropless: token-expert pairs are sorted by expert and fed to `lax.ragged_dot` (on a GPU the
grouped-matmul Pallas kernel, `kernels.grouped_matmul`), so memory is `O(tokens * top_k * D)` whatever
the routing. Routed-expert LoRA (per-expert A and B)
runs on the same sorted rows with the same group sizes. The routed experts run on one device
(`grouped_mlp.experts_ragged`) or, under a mesh that shards the experts, expert-parallel
(`expert_parallel.experts_ep`); both apply the same `grouped_mlp.grouped_swiglu`.

Axis letters: T tokens, D model, I expert intermediate, E experts, G groups, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax.config import ModelConfig
from glm52_jax.model import context_parallel as context
from glm52_jax.model import fp8
from glm52_jax.model.expert_parallel import experts_ep, pad_tokens, token_shards
from glm52_jax.model.grouped_mlp import experts_ragged
from glm52_jax.model.layers import param, project
from glm52_jax.model.lora import LoRAConfig, adapter
from glm52_jax.model.options import ModelOptions
from glm52_jax.parallel.rules import constrain


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); `lora_family` names its LoRA family (dense / shared)."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
                 lora_family: str = "dense_mlp"):
        self.gate_proj = param(rngs, (hidden, intermediate), ("embed", "mlp"), dtype)
        self.up_proj = param(rngs, (hidden, intermediate), ("embed", "mlp"), dtype)
        self.down_proj = param(rngs, (intermediate, hidden), ("mlp", "embed"), dtype)
        d, i, d_axes, i_axes = (hidden,), (intermediate,), ("embed",), ("mlp",)
        self.gate_proj_lora = adapter(lora, lora_family, "gate_proj", d, d_axes, i, i_axes, rngs)
        self.up_proj_lora = adapter(lora, lora_family, "up_proj", d, d_axes, i, i_axes, rngs)
        self.down_proj_lora = adapter(lora, lora_family, "down_proj", i, i_axes, d, d_axes, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        lay = context.current()
        if lay is not None and x.ndim == 3 and (blocks := context.whole_blocks(x.shape[1], lay.ways)) > 1:
            # A long whole-sequence CP forward: [B,S,I] float32 GEMM outputs for 262,144 tokens per device (12 GiB
            # each at I = 12,288) exist for one block of tokens at a time.
            xs = context.split_blocks(x, 1, lay.ways, blocks)
            return context.join_blocks(jax.lax.map(self._swiglu, xs), 1, lay.ways, blocks)
        return self._swiglu(x)

    def _swiglu(self, x: jax.Array) -> jax.Array:
        gate = project(x, self.gate_proj, "...d,di->...i", self.gate_proj_lora)
        h = jax.nn.silu(gate) * project(x, self.up_proj, "...d,di->...i", self.up_proj_lora)
        return project(h, self.down_proj, "...i,id->...d", self.down_proj_lora)


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Router `logits: [T,E]` float32 (x W_r) -> (weights [T,K] float32, experts [T,K] int32)."""
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    groups = cfg.n_group
    if groups > 1:
        grouped = choice.reshape(-1, groups, cfg.n_routed_experts // groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T,G]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        rows = jnp.arange(group_scores.shape[0])[:, None]
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[rows, keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, cfg.n_routed_experts // groups, axis=-1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)


class MoE(nnx.Module):
    """Routed experts + shared expert (HF `GlmMoeDsaMoE`)."""

    def __init__(self, cfg: ModelConfig, opts: ModelOptions, rngs: nnx.Rngs):
        dt = opts.param_dtype
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.token_block = opts.moe_token_block
        self.kernels = opts.kernels
        self.transport = opts.moe_transport
        self.receive_capacity = opts.moe_receive_capacity
        self.exchange_windows = opts.moe_exchange_windows
        self.node_devices = opts.moe_node_devices
        self.fp8_experts = opts.expert_dtype == "fp8"
        self.router = param(rngs, (d, e), ("embed", None), jnp.float32)
        self.e_score_correction_bias = param(None, (e,), (None,), jnp.float32, init="zeros")
        self.w_gate = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), dt)
        self.w_up = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), dt)
        self.w_down = param(rngs, (e, i, d), ("experts", "expert_mlp", "embed"), dt)
        self.shared_experts = MLP(d, i * cfg.n_shared_experts, dt, rngs, opts.lora, "shared_expert")
        experts = dict(lead_shape=(e,), lead_axes=("experts",))
        self.w_gate_lora = adapter(opts.lora, "routed_experts", "w_gate", (d,), ("embed",), (i,), ("expert_mlp",),
                                   rngs, **experts)
        self.w_up_lora = adapter(opts.lora, "routed_experts", "w_up", (d,), ("embed",), (i,), ("expert_mlp",),
                                 rngs, **experts)
        self.w_down_lora = adapter(opts.lora, "routed_experts", "w_down", (i,), ("expert_mlp",), (d,), ("embed",),
                                   rngs, **experts)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B,S,D] -> [B,S,D]`."""
        # Arrays, or `fp8.Fp8Weight`s that `grouped_swiglu` dequantizes on the experts it runs (EP: the local ones).
        expert_weights = (self.w_gate.get_value(), self.w_up.get_value(), self.w_down.get_value())
        if self.fp8_experts:  # w8a8: quantized once per call here (each expert where it lives), not per block or round
            expert_weights = tuple(fp8.for_fp8_mma(w) for w in expert_weights)
        lay = context.current()
        if lay is not None and (blocks := context.whole_blocks(x.shape[1], lay.ways)) > 1:
            # A long whole-sequence CP forward: the exchange's float32 output for every local token (6 GiB at
            # 262,144 tokens per device) exists for one block at a time. Each block holds whole rounds of
            # `token_block` tokens of every device, so the rounds (and their passes) are the unblocked ones.
            xs = context.split_blocks(x, 1, lay.ways, blocks)
            ys = jax.lax.map(lambda xb: self._experts(xb, expert_weights), xs)
            return context.join_blocks(ys, 1, lay.ways, blocks)
        return self._experts(x, expert_weights)

    def _experts(self, x: jax.Array, expert_weights) -> jax.Array:
        batch, seq, d = x.shape
        flat = x.reshape(-1, d)
        # float32 router through `project` (a few tokens' call keeps it in place, as the other weights)
        logits = project(flat.astype(jnp.float32), self.router, "td,de->te")
        weights, experts = route(self.cfg, logits, self.e_score_correction_bias[...])
        lora = (self.w_gate_lora, self.w_up_lora, self.w_down_lora)
        shards = token_shards(self.cfg.n_routed_experts)
        if shards:
            # Experts sharded over a mesh axis: every token count (a decode step's few tokens padded to one per
            # shard) goes to the experts' owners by all-to-all; the expert weights never move.
            padded = pad_tokens(flat, weights, experts, shards, self.cfg.n_routed_experts)
            routed = experts_ep(*padded, *expert_weights, lora, token_block=self.token_block, impl=self.transport,
                                kernels=self.kernels, receive_capacity=self.receive_capacity,
                                exchange_blocks=self.exchange_windows,
                                node_devices=self.node_devices)[:flat.shape[0]]
        else:
            routed = experts_ragged(flat, weights, experts, *expert_weights, lora, self.kernels)
        routed = routed.astype(x.dtype).reshape(batch, seq, d)
        return constrain(routed + self.shared_experts(x), ("batch", "seq", "embed"))
