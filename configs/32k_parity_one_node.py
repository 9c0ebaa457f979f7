"""Gradient parity at 32K on ONE node (8 x H200), where configs/2m_one_node.py runs: configs/32k_parity.py's
comparison (conventional vs response_only vs shared_prefix on one rollout group, cases ratio1 and active_clip, no
optimizer step) on the one-node run's mesh and base weights.

    python -m glm52_jax.launch --mode=parity --config=configs/32k_parity_one_node.py \\
        --config.model.checkpoint=/ckpt/GLM-5.2-FP8 --workdir=/runs/parity32k_1n
    python -m glm52_jax.launch --mode=plan --config=configs/32k_parity_one_node.py \\
        --config.train.gradient_mode=conventional --config.plan.programs="('train',)" --workdir=/tmp/p32k1n

The BF16 base (~1.49 TB) does not fit 8 x 141 GiB, so the base weights are FP8 as configs/2m_one_node.py's
(every mode computes with the same weights: parity compares the modes, not the base's precision). The cache
stays in the parameter dtype (32K tokens: small), so response_only reads the rows conventional computes with,
as on the 32-device mesh, and the acceptance bounds of configs/32k_parity.py stand. Planned deviceless for 1x1x8
H200 (benchmarks/RESULTS.md, reports benchmarks/results/plan_32k_one_node_h200*.json): every program fits the 135.7 GB
budget, the largest the conventional gradient step (123.5 GB); one parity modeled at central 152 s (129-265 s).
Keys not set here keep configs/32k_parity.py's values.
"""

from pathlib import Path

from glm52_jax import run_defaults

HERE = Path(__file__).resolve().parent


def get_config():
    c = run_defaults.from_file(HERE / "32k_parity.py")
    c.name = "gradient_parity_32k_one_node"
    c.mesh = "folded=8"  # as configs/2m_one_node.py: TP1 / CP8 / EP8 / PP1 on one host
    c.model.base_weights = "fp8"
    c.plan.target = "h200"
    return c
