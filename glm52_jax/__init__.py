"""glm52-jax: GLM-5.2 (MLA + DeepSeek Sparse Attention + MoE) in JAX/Flax.

    model = glm52_jax.load_pretrained(path)          # HF checkpoint directory
    logits = glm52_jax.forward(model, input_ids)     # [B, S] int32 -> [B, S, V] float32 (model(input_ids), jitted)
    logp = glm52_jax.token_logprobs(model, input_ids)  # [B, S-1] float32

`forward` and `token_logprobs` run compiled (glm52_jax/compiled.py: one XLA program per model structure and
shapes, reused by later calls), as does a direct `model(input_ids)` call. The exports load on first use, so tools
that need no model (the evidence verifier, the roofline) start without importing JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_pretrained": "glm52_jax.checkpoint.hf",
    "save_pretrained": "glm52_jax.checkpoint.hf_save",
    "ModelConfig": "glm52_jax.config",
    "glm52": "glm52_jax.config",
    "tiny": "glm52_jax.config",
    "ModelOptions": "glm52_jax.model.options",
    "GlmMoeDsa": "glm52_jax.model.transformer",
    "token_logprobs": "glm52_jax.compiled",
    "forward": "glm52_jax.compiled",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glm52_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
