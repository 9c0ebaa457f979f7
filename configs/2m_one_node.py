"""The seed's exact-2M transaction on ONE node: 8 x H200 (CP8 / EP8 folded), FP8 base weights and cache.

    python -m glm52_jax.launch --config=configs/2m_one_node.py --config.model.checkpoint=/ckpt/GLM-5.2-FP8 \\
        --config.data.path=/data/dapo-math-17k.parquet --workdir=/runs/2m_one_node
    python -m glm52_jax.launch --config=configs/2m_one_node.py --mode=plan --workdir=/tmp/plan1n   # no weights

Everything of configs/2m.py (2,097,152-token prompts after a 64K engine probe, 16 new tokens, 8 samples per
request of which G = 2 train, response_only, the shared prompt cache, YaRN from configs/glm52_2m_yarn.json, the
bounded dense MoE exchange, tensor-parallel few-token calls) on 8 GPUs of one host instead of 32 of four. In BF16
the base is ~1.49 TB, which 8 x 141 GiB cannot hold; as the FP8 release stores it (e4m3 with 128 x 128 block scales
on the projection matrices, `model.base_weights="fp8"`: an FP8 checkpoint loads as stored, a BF16 one is quantized
as it is read) it is 746 GB, 93.3 GB per device. The plan compiles every program for the H200 with XLA's GPU
compiler (topology 1x1x8) and judges it against the H200's measured 150.75e9 B x 0.90 (the memory fraction the
launcher sets): with the FP8 cache and the whole-prompt prefill every program fits (largest: the prefill, 134.2 of
135.7 GB) and the first candidate (prefill + the 8 samples' decode) is modeled at central 371 s, 329-665 s
(benchmarks/RESULTS.md; benchmarks/results/plan_2m_one_node_h200.json, planned at fddbdb7).
Keys not set here keep configs/2m.py's values.
"""

from pathlib import Path

from glm52_jax import run_defaults

HERE = Path(__file__).resolve().parent


def get_config():
    c = run_defaults.from_file(HERE / "2m.py")
    c.name = "online_grpo_2m_one_node"
    c.mesh = "folded=8"  # TP1 / CP8 / EP8 / PP1: one 8-way axis for the sequence and the experts, one host
    c.model.base_weights = "fp8"
    c.plan.target = "h200"  # planned deviceless for 1x1x8 H200 (150.75e9 B each, measured; the budget is 0.90 of it)
    # The decode / prefix cache's latent and indexer keys in e4m3 with per-row scales: 13.9 GB per device instead of
    # 25.0 (bf16), which the programs holding two caches (a chunk's cache in and out) and train need to fit. The
    # prefix cache's 16 GiB per device (configs/2m.py) keeps it: the next candidate recomputes only its tail.
    c.model.cache_dtype = "float8_e4m3fn"
    # Whole-prompt prefill (configs/2m.py's), the lower estimate: one context-parallel forward whose attention, MLPs
    # and MoE run in 16,384-token blocks per device (context_parallel.WHOLE_QUERY_BLOCK) fits (134.7 of 135.7 GB)
    # and is modeled at 363 s central (322-652 s) against 128 x 14.5 s = 1,856 s for 16K chunks (127.6 GB, planned at
    # 38859220a9: benchmarks/results/plan_2m_one_node_h200_chunked.json). Every program planned in this mode in
    # session 16 (first candidate 315.3 s central; session 11: 370.7): benchmarks/results/plan_2m_one_node_h200.json.
    # One synchronous EP exchange per pass, not 2 software-pipelined windows (the default): over one
    # node's NVLink the all-to-all is short (23 s of the prefill) and nothing hid it, while each window re-reads the
    # local experts' weights and launches its own kernels: planned with 2 windows the prefill was 424.6 s central
    # (19.2M launches), with 1 window 367 s (benchmarks/RESULTS.md, session 11).
    c.model.moe_exchange_windows = 1
    c.model.moe_node_devices = 0  # one node: the one-stage exchange, all of it over NVLink
    # 256 tokens per round (glm52_release's; configs/2m.py's 4,096 sizes its two-stage buffers): this node's prefill
    # runs 134 of 135.7 GB, and the one-stage exchange's buffers grow with the round.
    c.model.moe_token_block = 256
    # The indexer scores in bf16 here. configs/2m.py's FP8 scoring with 4,096 rescored candidates, planned for this
    # node's prefill, fits (134.25 GB) but gains only 367 -> 360.6 s central: at 262,144 queries per device the wider
    # merge and the rescoring's row gathers cost most of what FP8 saves (benchmarks/RESULTS.md, session 14).
    c.model.indexer_dtype = "bf16"
    c.model.indexer_candidates = 0
    # The routed experts multiply in bf16 (their FP8 base dequantized in the grouped matmul). configs/2m.py's FP8
    # experts, planned here (session 16): prefill 321.7 -> 326.6 s central. In 256-token rounds the grouped matmuls
    # are bound by re-reading the local experts' weights every round, not by the tensor cores (32.8 s memory-bound
    # either way), and quantizing the rows adds 5.5 s of memory kernels and launches.
    c.model.expert_dtype = "bf16"
    return c
