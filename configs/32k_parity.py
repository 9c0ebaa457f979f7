"""Gradient parity at 32K (the seed's "Gradient parity" table): conventional vs response_only vs
shared_prefix on one rollout group, no optimizer step.

    python -m glm52_jax.launch --mode=parity --config=configs/32k_parity.py \\
        --config.model.checkpoint=/ckpt/GLM-5.2 --workdir=/runs/parity32k

Same model and LoRA as configs/2m.py; native positions suffice for 32,768 + 16 tokens.
"""

from glm52_jax import run_defaults


def get_config():
    c = run_defaults.glm52_release(run_defaults.get_config())
    c.name = "gradient_parity_32k"
    c.mesh = "folded=32"  # as configs/2m.py: parity runs on the run's mesh (one process or several)
    c.data.prompt_tokens = 32_768
    c.sampling.chunk_size = 4_096
    return c
