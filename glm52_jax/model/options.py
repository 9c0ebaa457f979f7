"""Run-time choices that are not part of the checkpoint's architecture."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from glm52_jax.choices import CACHE_DTYPES, EXPERT_DTYPES, INDEXER_DTYPES, KERNELS, MOE_TRANSPORTS
from glm52_jax.model.lora import LoRAConfig


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How to build and run a model: parameter dtype, block sizes, rematerialisation.

    `param_dtype` is also the activation dtype; the router, its correction bias and the indexer's
    `weights_proj` stay float32 whatever it is. Use float32 for parity checks.
    `lora`: low-rank adapters on the frozen base (see `model.lora`); None (default) builds none.
    `context_parallel`: how a whole-sequence forward runs attention when a mesh shards `seq`:
    "zigzag" (load-balanced layout) or "contiguous" explicit CP (`model.context_parallel`), or "off"
    (GSPMD places it). Cached chunks (prefill, decode) are not affected: a cache made under a mesh that shards its
    slots is strided over them (`kv_cache.SlotLayout`) and always read by the explicit path.
    `moe_token_block`: the expert-parallel MoE routes at most this many of a device's tokens per
    all-to-all round (a whole-prompt prefill holds 64K tokens per device at 2M; the exchange
    buffers grow with the tokens routed at once).
    `kernels`: the DSA indexer top-k and sparse attention implementation: "reference" (the jnp code
    in model/indexer.py and model/sparse_attention.py), "pallas" (glm52_jax.kernels; interpreted on a
    CPU backend, which is how CPU tests run them) or "auto" (pallas on a GPU backend, else reference).
    Both give the same results (see tests/kernels). It also picks the routed experts' grouped matmul
    (`kernels.grouped_matmul` where Pallas is chosen, `lax.ragged_dot` otherwise).
    `moe_transport`: how the expert-parallel MoE exchanges token rows: "dense" (fixed-capacity
    all_to_all, runs everywhere), "ragged" (`ragged_all_to_all`: only the rows each device needs; GPU)
    or "auto" (ragged when the program is lowered for a GPU, else dense).
    `moe_receive_capacity`: the ragged exchange's receive buffer in multiples of the rows a device sends per
    round (balanced routing brings that many on average); rows beyond it go in further passes, so nothing is
    dropped. 0 (default) sizes it for the worst case (N times: one pass, but every op on the received rows
    runs over N times the live rows).
    `moe_exchange_windows`: windows each expert-parallel pass's exchange is split into (`experts_ep`'s
    `exchange_blocks`): with 2 (default) one window's all-to-all is in flight while the other's experts compute;
    1 runs each pass as one synchronous exchange (fewer, larger kernels: each window re-reads the local experts'
    weights).
    `moe_node_devices`: with the dense transport, g > 0 consecutive devices of the expert axis that share a node
    (NVLink within, the network across): each token then crosses the network once to every other node, not once
    per expert, and reaches its experts there over NVLink (`expert_parallel._node_body`); 0 (default): one exchange
    over the axis.
    `gather_weights_min_tokens`: a call (layer stack, logits) that routes fewer tokens than this (static:
    B x S) keeps the FSDP-sharded frozen matrices in place and runs their projections tensor-parallel
    (`parallel.tensor_parallel`: the activations move, not the weights); 0 (default) always gathers.
    `cache_dtype`: what the decode / prefix caches store of the MLA latent and the indexer key: "auto" (the
    parameter dtype) or "float8_e4m3fn" (e4m3 with one float32 scale per cached row, `model/cache_fp8.py`:
    half of bf16's bytes). The sampler's caches, response_only's prefix and the new log-probs' prompt use it;
    shared_prefix keeps its differentiated prefix in the parameter dtype (rounding has no gradient).
    `indexer_dtype`: what the DSA indexer scores in (`model.indexer`): "bf16" (default: q and k as values of the
    parameter dtype, float32 in a float32 parity model) or "fp8" (q per (token, head) and k per row quantized to e4m3
    with one float32 scale each after a Hadamard rotation, FP8 MMA in the Pallas kernel; an FP8 cache's keys are read
    as stored). Selection only: attention and every gradient are unchanged, but the top-k may differ from bf16's
    where scores nearly tie.
    `indexer_candidates`: with "fp8", M > 0 (more than the config's index_topk) keeps FP8's best M keys per query
    and selects the top-k of them rescored unquantized, bf16 scoring's selection wherever bf16's top-k ranks within
    FP8's top M (`model.indexer`; q and k are then not rotated); 0 (default): FP8's own top-k. Ignored with "bf16".
    `expert_dtype`: what the routed experts multiply in (`model.grouped_mlp`): "bf16" (default: the parameter dtype;
    an FP8 base's blocks dequantized to it) or "fp8" (w8a8, DeepSeek-V3's FP8 recipe: each row quantized to e4m3 per
    128 of its width, the expert kernels e4m3 in 128 x 128 blocks, an FP8 base's as stored, a float base's quantized
    in the program by the releases' rule; FP8 MMA on the grouped-matmul kernel). Gradients pass straight through
    the rows' quantization; the LoRA deltas, the router and the shared expert are unchanged.
    `latent_norm_eps`: the epsilon of the MLA q / kv latent RMSNorms; None (default) is HF glm_moe_dsa's 1e-6
    (`model.mla.LATENT_NORM_EPS`). megatron-core, vLLM and HF's glm5_next use the config's rms_norm_eps there
    (docs/DESIGN.md, parity); no checkpoint records which one a model was trained with.
    """

    param_dtype: object = jnp.bfloat16
    indexer_query_block: int = 128
    indexer_key_block: int = 512
    attention_query_block: int = 64
    remat: bool = True
    lora: LoRAConfig | None = None
    context_parallel: str = "zigzag"
    moe_token_block: int = 1024
    kernels: str = "auto"
    moe_transport: str = "auto"
    moe_receive_capacity: float = 0.0
    moe_exchange_windows: int = 2
    moe_node_devices: int = 0
    gather_weights_min_tokens: int = 0
    cache_dtype: str = "auto"
    indexer_dtype: str = "bf16"
    indexer_candidates: int = 0
    expert_dtype: str = "bf16"
    latent_norm_eps: float | None = None

    def __post_init__(self):
        for name in ("indexer_query_block", "indexer_key_block", "attention_query_block", "moe_token_block",
                     "moe_exchange_windows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelOptions.{name}: expected a positive integer, got {value!r}")
        for name in ("gather_weights_min_tokens", "moe_node_devices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelOptions.{name}: expected an integer >= 0, got {value!r}")
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        if self.context_parallel not in ("zigzag", "contiguous", "off"):
            raise ValueError(f"ModelOptions.context_parallel: expected 'zigzag', 'contiguous' or 'off', "
                             f"got {self.context_parallel!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"ModelOptions.kernels: expected one of {KERNELS}, got {self.kernels!r}")
        if self.moe_transport not in MOE_TRANSPORTS:
            raise ValueError(f"ModelOptions.moe_transport: expected one of {MOE_TRANSPORTS}, "
                             f"got {self.moe_transport!r}")
        if not (self.moe_receive_capacity == 0 or self.moe_receive_capacity >= 1):
            raise ValueError(f"ModelOptions.moe_receive_capacity: expected 0 (worst case) or >= 1, "
                             f"got {self.moe_receive_capacity!r}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"ModelOptions.cache_dtype: expected one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        if self.indexer_dtype not in INDEXER_DTYPES:
            raise ValueError(f"ModelOptions.indexer_dtype: expected one of {INDEXER_DTYPES}, "
                             f"got {self.indexer_dtype!r}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"ModelOptions.expert_dtype: expected one of {EXPERT_DTYPES}, got {self.expert_dtype!r}")
        cands = self.indexer_candidates
        if isinstance(cands, bool) or not isinstance(cands, int) or cands < 0:
            raise ValueError(f"ModelOptions.indexer_candidates: expected an int >= 0, got {cands!r}")
        eps = self.latent_norm_eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
            raise ValueError(f"ModelOptions.latent_norm_eps: expected None or a number in (0, 1), got {eps!r}")
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise ValueError(f"ModelOptions.lora: expected a LoRAConfig or None, got {self.lora!r}")
