"""Embedded default: one online GRPO transaction with the project's tiny GLM-5.2 policy on CPU.

    python -m glm52_jax.launch --config=configs/tiny.py --workdir=/tmp/run
    python -m glm52_jax.launch --config=configs/tiny.py --config.search.max_candidates=4
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "online_grpo_tiny"
    c.seed = 0
    c.mesh = ""  # "" = one device; e.g. "context=4,expert=2" or "folded=8" (parallel/mesh.py)

    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = "embedded"  # the shipped tiny policy; a directory path; or "random" (seeded init)
    c.model.preset = "tiny"  # architecture for "random"
    c.model.dtype = "float32"
    c.model.rope_scaling_json = ""  # a YaRN payload file; "" = $GLM52_ROPE_SCALING_JSON if set, else native
    c.model.tokenizer = ""  # tokenizer.json (or its dir); "" = the checkpoint's, else the project's tiny one
    c.model.lora_rank = 8
    c.model.lora_alpha = 16.0
    c.model.lora_families = ("attention", "routed_experts", "shared_expert", "dense_mlp", "unembed")

    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # "" = the bundled DAPO-schema rows
    c.data.dedupe = False
    c.data.first_row = 0  # candidate i uses row (first_row + i) mod rows
    c.data.prompt_tokens = 256  # exact prompt length N

    c.sampling = ml_collections.ConfigDict()
    c.sampling.num_samples = 2  # G
    c.sampling.max_new_tokens = 32
    c.sampling.temperature = 1.0
    c.sampling.top_p = 1.0
    c.sampling.top_k = 0
    c.sampling.chunk_size = 128
    c.sampling.prefill_mode = "chunked"  # chunked | whole (one context-parallel forward for a cold prompt)
    c.sampling.prefix_cache_mib = 256

    c.search = ml_collections.ConfigDict()
    c.search.max_candidates = 8

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1  # transactions; each commits a receipt, then an Orbax checkpoint (resumable)
    c.train.gradient_mode = "response_only"  # conventional | response_only | shared_prefix
    c.train.learning_rate = 1e-4
    c.train.weight_decay = 0.0
    c.train.max_grad_norm = 1.0
    c.train.clip_ratio_low = 0.2
    c.train.clip_ratio_high = 0.28
    c.train.loss_agg_mode = "token-mean"

    c.parity = ml_collections.ConfigDict()  # --mode=parity: gradient modes compared on one rollout group
    c.parity.modes = ("conventional", "response_only", "shared_prefix")
    c.parity.reference = "conventional"

    c.plan = ml_collections.ConfigDict()
    c.plan.programs = ("prefill", "decode", "train")
    c.plan.hbm_gib = 96.0  # --mode=plan: per-device memory budget the compiled programs must fit
    return c
