"""The seed's run: one exact-2M online GRPO transaction of GLM-5.2 on 32 GPUs (CP32 / EP32 folded).

    python -m glm52_jax.launch --config=configs/2m.py --config.model.checkpoint=/ckpt/GLM-5.2 \\
        --config.data.path=/data/dapo-math-17k.parquet --workdir=/runs/2m
    python -m glm52_jax.launch --config=configs/2m.py --mode=plan     # AOT memory / FLOP plan, no weights

2,097,152 prompt tokens + 16 new tokens need the YaRN factor-2 payload (seed, "Position
adaptation"), applied here explicitly from configs/glm52_2m_yarn.json. Keys not set here keep the
defaults of glm52_jax/run_defaults.py.
"""

from pathlib import Path

from glm52_jax import run_defaults


def get_config():
    c = run_defaults.glm52_release(run_defaults.get_config())
    c.name = "online_grpo_2m"
    c.mesh = "folded=32"  # TP1 / CP32 / EP32 / PP1: one 32-way axis for the sequence and the experts
    c.model.rope_scaling_json = str(Path(__file__).resolve().parent / "glm52_2m_yarn.json")
    # The frozen non-expert weights (~37.5 GB: attention, indexer, dense and shared MLPs, embedding, lm_head) 1/32 per
    # device, all-gathered one layer at a time inside the layer scan (the run default; stated as the plan assumes it).
    c.model.weight_sharding = "fsdp"
    c.data.prompt_tokens = 2_097_152
    c.sampling.chunk_size = 16_384
    # One context-parallel forward of the cold prompt (plan: 560 GB all-gathered per prefill vs ~29 TB for
    # 128 chunks of 16K, each re-reading the key side); "chunked" runs `chunk_size` chunks against the cache.
    c.sampling.prefill_mode = "whole"
    # The 2M prompt's cache is ~211 GB in all, ~6.6 GB per device over 32: the budget keeps it, so the next
    # candidate (same filler, another question) recomputes only its tail chunks.
    c.sampling.prefix_cache_mib_per_device = 16_384
    # The seed drew 8 samples per exact-2M request and trained on a group of G = 2 of them.
    c.sampling.samples_per_request = 8
    c.search.probe_tokens = 65_536  # the seed's 64K engine probe before the exact-2M requests
    # The indexer scores in bf16, not FP8 (issue 33): FP8 scoring (e4m3 q / k, per-row scales) changes which keys
    # are selected where scores nearly tie (benchmarks/indexer_fp8.py: top-32 overlap 0.967 on the tiny policy's
    # activations, greedy decoding 24 / 32 tokens equal; top-2048 overlap 0.986 / 0.972 / 0.960 at 4K / 16K / 64K
    # keys on a random GLM-5.2-width indexer, falling with length), so the run would no longer compute the bf16
    # reference's selection. `--config.model.indexer_dtype=fp8` plans / runs it with FP8 (modeled first candidate:
    # RESULTS.md).
    c.model.indexer_dtype = "bf16"
    return c
