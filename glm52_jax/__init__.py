"""glm52-jax: GLM-5.2 (MLA + DeepSeek Sparse Attention + MoE) in JAX/Flax.

    model = glm52_jax.load_pretrained(path)          # HF checkpoint directory
    logits = model(input_ids)                        # [B, S] int32 -> [B, S, V] float32
    logp = glm52_jax.token_logprobs(model, input_ids)  # [B, S-1] float32
"""

from glm52_jax.checkpoint.hf import load_pretrained, save_pretrained
from glm52_jax.config import ModelConfig, glm52, tiny
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa, token_logprobs

__all__ = ["GlmMoeDsa", "ModelConfig", "ModelOptions", "glm52", "load_pretrained", "save_pretrained", "tiny",
           "token_logprobs"]
