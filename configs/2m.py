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
    # The indexer's O(S x T) scoring runs on FP8 tensor cores (e4m3 q and k, per-row scales; twice bf16's MMA rate)
    # and still selects bf16's top-2048: FP8 keeps each query's best 4,096 keys, those are rescored unquantized (bf16
    # values, float32 sums) and the top-2048 of them is the selection (`model.indexer`). On a random GLM-5.2-width
    # indexer bf16's top-2048 reached at most rank 2,837 / 3,524 of FP8's order at 64K / 2M keys (FP8's own top-2048
    # kept 0.962 / 0.942 of it); selection overlap with bf16 1.0 at 4K-64K keys, and on the tiny policy 1.0 with
    # greedy tokens unchanged (benchmarks/indexer_fp8.py, RESULTS.md). Modeled first candidate (session 14) 277.6 s
    # central, 337.6 with `--config.model.indexer_dtype=bf16` (bf16 scoring throughout); with everything below, 193.9 s
    # (session 16: benchmarks/results/plan_2m_h20.json).
    # The MoE exchange in two stages (4 hosts x 8 GPUs): a token crosses the network once to each other host, not
    # once per expert, and reaches its experts' GPUs over NVLink; each host's weighted sum comes back once. Planned
    # (prefill, whole prompt): all-to-all bytes across hosts 1,465 -> 379 GB per device, all-to-all 55.7 -> 23.9 s,
    # prefill 274 -> 248 s central (benchmarks/RESULTS.md).
    c.model.moe_node_devices = 8
    # ... with 4,096 tokens per device per exchange round (glm52_release's 256 sized the one-stage exchange's
    # buffers): a sixteenth of the rounds' launches and latencies (prefill, central: 1,024 tokens 248 -> 238 s; with
    # FP8 experts 2,048 tokens 203.5 -> 202.6 s, 4,096 with FP8 rows in transit 196.4 -> 196.0 s; memory unchanged),
    # and each destination's chunk within a host averages 2,048 pairs, so capacity 2 takes a second pass less often.
    c.model.moe_token_block = 4096
    # ... in one window per round: the deviceless H20 compile overlaps neither stage's all-to-alls with the experts
    # in 2 windows (XLA's scheduler keeps other exchanges and no grouped matmul between a start and its done), and
    # each window costs its own launches: prefill 220.4 s (2 windows) -> 220.0 s, 1.18M -> 0.76M launches.
    c.model.moe_exchange_windows = 1
    c.model.indexer_dtype = "fp8"
    c.model.indexer_candidates = 4096
    # The routed experts multiply in FP8 (w8a8, DeepSeek-V3's FP8 recipe, as GLM-5's FP8 release is served): each token
    # row quantized to e4m3 per 128 of its width once at its device and sent so through both exchange stages (6,336
    # bytes a row against bf16's 12,288), the expert kernels quantized per 128 x 128 block, FP8 MMA on the grouped
    # matmul (twice bf16's rate); gradients straight through the rows' quantization. The experts are quantized once,
    # as read (`hf_fp8.EXPERTS`: half their bytes on device). Planned prefill 220.0 -> 196.4 s central (grouped
    # matmuls 35.5 -> 17.6 s, all-to-all 24.0 -> 18.4 s); accuracy in benchmarks/RESULTS.md
    # (benchmarks/experts_fp8.py). `--config.model.expert_dtype=bf16` restores bf16 experts.
    c.model.expert_dtype = "fp8"
    return c
