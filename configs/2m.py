"""The seed's run: one exact-2M online GRPO transaction of GLM-5.2 on 32 GPUs (CP32 / EP32 folded).

    python -m glm52_jax.launch --config=configs/2m.py --config.model.checkpoint=/ckpt/GLM-5.2 \\
        --config.data.path=/data/dapo-math-17k.parquet --workdir=/runs/2m
    python -m glm52_jax.launch --config=configs/2m.py --mode=plan     # AOT memory / FLOP plan, no weights

2,097,152 prompt tokens + 16 new tokens need the YaRN factor-2 payload (seed, "Position
adaptation"), applied here explicitly from configs/glm52_2m_yarn.json.
"""

from pathlib import Path

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "online_grpo_2m"
    c.seed = 0
    c.mesh = "folded=32"  # TP1 / CP32 / EP32 / PP1: one 32-way axis for the sequence and the experts

    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = "/ckpt/GLM-5.2"  # the BF16 HF release directory (override per machine)
    c.model.preset = "glm52"  # architecture for plan mode when the checkpoint is not on this machine
    c.model.dtype = "bfloat16"
    c.model.rope_scaling_json = str(Path(__file__).resolve().parent / "glm52_2m_yarn.json")
    c.model.tokenizer = ""  # tokenizer.json (or its dir); "" = the checkpoint's, else the project's tiny one
    c.model.lora_rank = 8
    c.model.lora_alpha = 16.0
    c.model.lora_families = ("attention", "routed_experts", "shared_expert", "dense_mlp", "unembed")

    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # DAPO-Math-17k parquet/JSONL; "" = the bundled rows
    c.data.dedupe = True  # the public parquet repeats each prompt ~100x
    c.data.first_row = 0
    c.data.prompt_tokens = 2_097_152  # exact prompt length N

    c.sampling = ml_collections.ConfigDict()
    c.sampling.num_samples = 2  # G
    c.sampling.max_new_tokens = 16
    c.sampling.temperature = 1.0
    c.sampling.top_p = 1.0
    c.sampling.top_k = 0
    c.sampling.chunk_size = 16_384
    # One context-parallel forward of the cold prompt (plan: 560 GB all-gathered per prefill vs ~29 TB for
    # 128 chunks of 16K, each re-reading the key side); "chunked" runs `chunk_size` chunks against the cache.
    c.sampling.prefill_mode = "whole"
    c.sampling.prefix_cache_mib = 16_384

    c.search = ml_collections.ConfigDict()
    c.search.max_candidates = 8

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1
    c.train.gradient_mode = "response_only"
    c.train.learning_rate = 1e-5
    c.train.weight_decay = 0.0
    c.train.max_grad_norm = 1.0
    c.train.clip_ratio_low = 0.2
    c.train.clip_ratio_high = 0.28
    c.train.loss_agg_mode = "token-mean"

    c.plan = ml_collections.ConfigDict()
    c.plan.programs = ("prefill", "decode", "train")
    c.plan.hbm_gib = 96.0  # H20
    return c
