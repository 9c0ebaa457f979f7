"""The seed's exact-2M transaction on ONE node: 8 x H200 (CP8 / EP8 folded), FP8 base weights.

    python -m glm52_jax.launch --config=configs/2m_one_node.py --config.model.checkpoint=/ckpt/GLM-5.2-FP8 \\
        --config.data.path=/data/dapo-math-17k.parquet --workdir=/runs/2m_one_node
    python -m glm52_jax.launch --config=configs/2m_one_node.py --mode=plan --workdir=/tmp/plan1n   # no weights

Everything of configs/2m.py (2,097,152-token prompts after a 64K engine probe, 16 new tokens, 8 samples per
request of which G = 2 train, whole-prompt prefill, the shared prompt cache, YaRN from configs/glm52_2m_yarn.json,
the bounded dense MoE exchange, tensor-parallel few-token calls) on 8 GPUs of one host instead of 32 of four.
In BF16 the base is ~1.49 TB, which 8 x 141 GB cannot hold; as the FP8 release stores it (e4m3 with 128 x 128
block scales on the projection matrices, `model.base_weights="fp8"`: the FP8 checkpoint loads as stored, the BF16
one is quantized as it is read) it is ~0.75 TB, 1/8 per device. The plan compiles every program for the H200
with XLA's GPU compiler (topology 1x1x8) and judges it against 141 GB x 0.90 (the launcher's memory fraction).
Keys not set here keep configs/2m.py's values.
"""

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _two_million():
    spec = importlib.util.spec_from_file_location("configs_2m", HERE / "2m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config():
    c = _two_million()
    c.name = "online_grpo_2m_one_node"
    c.mesh = "folded=8"  # TP1 / CP8 / EP8 / PP1: one 8-way axis for the sequence and the experts, one host
    c.model.base_weights = "fp8"
    c.plan.target = "h200"  # planned deviceless for 1x1x8 H200 (141 GB each; the budget is 0.90 of it)
    # Chunked prefill: 128 calls of 16K against the cache (each holds the weights, the cache in and the cache out:
    # 148.8 GB planned) instead of one whole-prompt forward (203.6 GB: its 2M-token activations and the output cache's
    # re-layout copies); neither fits 136.3 GB with a bf16 cache yet (BUILD_NOTES: what closes it).
    c.sampling.prefill_mode = "chunked"
    # The 2M prompt's cache is ~211 GB in all, ~26 GB per device over 8: the prefix cache keeps it (the next candidate
    # of the same filler recomputes only its tail).
    c.sampling.prefix_cache_mib_per_device = 32_768
    return c
