"""Gradient parity at 32K (the seed's "Gradient parity" table): conventional vs response_only vs
shared_prefix on one rollout group, in two cases (ratio1, active_clip), no optimizer step.

    python -m glm52_jax.launch --mode=parity --config=configs/32k_parity.py \\
        --config.model.checkpoint=/ckpt/GLM-5.2 --workdir=/runs/parity32k

Same model and LoRA as configs/2m.py, on the same 32-device mesh; native positions suffice for
32,768 + 16 tokens. The receipt is WORKDIR/evidence/gradient_parity_32k.json.
"""

from glm52_jax import run_defaults


def get_config():
    c = run_defaults.glm52_release(run_defaults.get_config())
    c.name = "gradient_parity_32k"
    c.mesh = "folded=32"  # as configs/2m.py: parity runs on the run's mesh (one process or several)
    c.data.prompt_tokens = 32_768
    c.sampling.chunk_size = 4_096
    # bfloat16 bounds: the seed's response_only measured global cosine 0.99993 and relative L2 0.0117 (both cases)
    # and log-prob max |diff| 2.4e-7; shared_prefix differs from conventional by bf16 reassociation only.
    c.parity.acceptance = (
        "shared_prefix: cosine >= 0.9999, rel_l2 <= 0.01, logprob_abs <= 1e-2, loss_abs <= 1e-3",
        "response_only: cosine >= 0.9999, rel_l2 <= 0.02, logprob_abs <= 1e-2, loss_abs <= 1e-3",
    )
    return c
