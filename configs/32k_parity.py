"""Gradient parity at 32K (the seed's "Gradient parity" table): conventional vs response_only vs
shared_prefix on one rollout group, no optimizer step.

    python -m glm52_jax.launch --mode=parity --config=configs/32k_parity.py \\
        --config.model.checkpoint=/ckpt/GLM-5.2 --workdir=/runs/parity32k

Same model and LoRA as configs/2m.py; native positions suffice for 32,768 + 16 tokens.
"""

import importlib.util
from pathlib import Path

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location("config_2m", Path(__file__).resolve().parent / "2m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.name = "gradient_parity_32k"
    c.model.rope_scaling_json = ""
    c.data.prompt_tokens = 32_768
    c.sampling.chunk_size = 4_096
    c.parity = ml_collections.ConfigDict()
    c.parity.modes = ("conventional", "response_only", "shared_prefix")
    c.parity.reference = "conventional"
    return c
