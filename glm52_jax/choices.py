"""The names a run config may choose from, in one place (no JAX: the run spec validates with them).

The modules that implement each choice import their tuple from here, so a new mode is added once.
"""

from __future__ import annotations

# parallel/ imports nothing else of the package, so its choice lives there: frozen base weights sharded over every
# device (FSDP-style, gathered one layer at a time where used) or replicated
from glm52_jax.parallel.mesh import WEIGHT_SHARDINGS  # noqa: F401  (re-exported)

GRADIENT_MODES = ("conventional", "response_only", "shared_prefix")  # rl/gradients.py
PREFILL_MODES = ("chunked", "whole")  # rollout/sampler.py
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # rl/grpo.py
LORA_FAMILIES = ("attention", "routed_experts", "shared_expert", "dense_mlp", "unembed")  # model/lora.py
KERNELS = ("auto", "reference", "pallas")  # model/options.py: auto = pallas on GPU, reference elsewhere
MOE_CROSS_HOST = ("xla", "nccl")  # parallel/xla_options.py: how XLA:GPU runs the MoE exchange across hosts
MOE_TRANSPORTS = ("auto", "dense", "ragged")  # model/expert_parallel.py: auto = ragged on GPU, dense elsewhere
DTYPES = ("float32", "bfloat16")  # parameter (and activation) dtype of the base model
CACHE_DTYPES = ("auto", "float8_e4m3fn")  # model/cache_fp8.py: decode-cache latent + indexer key; auto = model dtype
# model/indexer.py: what the DSA indexer scores in: bf16 = the parameter dtype (float32 in a float32 model), fp8 = e4m3
# queries and keys with per-row scales on FP8 tensor cores
INDEXER_DTYPES = ("bf16", "fp8")
EXPERT_DTYPES = ("bf16", "fp8")  # what the routed experts multiply in (model.expert_dtype)
# rl/inputs.py base_fp8: the base weights on device as the checkpoint stores them, or FP8 as the release stores them
BASE_WEIGHTS = ("stored", "fp8")
PRESETS = ("tiny", "glm52")  # config.py architectures for `model.checkpoint="random"` and plan mode
CHECKPOINT_KEYWORDS = ("embedded", "random")  # model.checkpoint besides a directory path
# plan/: programs plan mode can compile
PLAN_PROGRAMS = ("prefill", "prefill_tail", "forward", "decode", "train", "new_logprobs", "inventory", "probe_prefill",
                 "probe_decode")
# plan/targets.py: where plan mode compiles (virtual CPU devices, or deviceless for these GPUs)
PLAN_TARGETS = ("cpu", "h20", "h200")
