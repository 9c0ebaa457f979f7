"""The objects a run builds from its spec, each built here and nowhere else.

`run_config` holds the settings (no JAX, no model code); these functions turn them into the model's,
sampler's and optimizer's own configuration objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from glm52_jax.run_config import ModelSpec, SamplingSpec, TrainSpec


def lora_config(model: ModelSpec):
    """`model.lora.LoRAConfig` of the run's adapters."""
    from glm52_jax.model.lora import LoRAConfig

    return LoRAConfig(rank=model.lora_rank, alpha=model.lora_alpha, families=frozenset(model.lora_families))


def model_options(model: ModelSpec):
    """`ModelOptions` of the base model: parameter dtype, kernels, the MoE exchange, the cache and indexer
    dtypes, the experts' matmul dtype (the rest at their defaults)."""
    from glm52_jax.model.options import ModelOptions

    return ModelOptions(param_dtype=model.jnp_dtype(), kernels=model.kernels, moe_transport=model.moe_transport,
                        moe_token_block=model.moe_token_block, moe_receive_capacity=model.moe_receive_capacity,
                        moe_exchange_windows=model.moe_exchange_windows, moe_node_devices=model.moe_node_devices,
                        gather_weights_min_tokens=model.gather_weights_min_tokens, cache_dtype=model.cache_dtype,
                        indexer_dtype=model.indexer_dtype, indexer_candidates=model.indexer_candidates,
                        expert_dtype=model.expert_dtype)


def loss_settings(train: TrainSpec):
    from glm52_jax.rl.gradients import LossSettings

    return LossSettings(clip_ratio_low=train.clip_ratio_low, clip_ratio_high=train.clip_ratio_high,
                        loss_agg_mode=train.loss_agg_mode)


def adamw(train: TrainSpec):
    from glm52_jax.rl.update import AdamWConfig

    return AdamWConfig(learning_rate=train.learning_rate, weight_decay=train.weight_decay,
                       max_grad_norm=train.max_grad_norm)


def sampling_params(sampling: SamplingSpec, stop_token_ids: Sequence[int], seed: int):
    """The sampler's `SamplingParams` for one request: `sampling.per_request` samples."""
    from glm52_jax.rollout.sampler import SamplingParams

    return SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, top_k=sampling.top_k, stop_token_ids=tuple(stop_token_ids),
                          num_samples=sampling.per_request, seed=seed)


def sampler(sampling: SamplingSpec, model, progress: Callable | None = None, decode_progress: Callable | None = None):
    """The policy sampler over `model` with the spec's chunking, cache budget and prefill mode; `progress` gets
    its prefill chunks, `decode_progress(done, steps)` (if given) every decode step of the compiled loop."""
    from glm52_jax.rollout.sampler import Sampler

    return Sampler(model, chunk_size=sampling.chunk_size, prefix_cache_bytes=sampling.prefix_cache_mib_per_device << 20,
                   progress=progress or (lambda *a: None), prefill_mode=sampling.prefill_mode,
                   decode_progress=decode_progress)
