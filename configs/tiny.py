"""Embedded default: one online GRPO transaction with the project's tiny GLM-5.2 policy on CPU.

    python -m glm52_jax.launch --config=configs/tiny.py --workdir=/tmp/run
    python -m glm52_jax.launch --config=configs/tiny.py --config.search.max_candidates=4

Every key, its default and meaning: glm52_jax/run_defaults.py (this config is those defaults).
"""

from glm52_jax import run_defaults


def get_config():
    return run_defaults.get_config()
