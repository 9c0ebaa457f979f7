"""Builds random HF transformers GLM-MoE-DSA models (the PyTorch reference) for tests."""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers

from glm52_jax.config import ModelConfig


def hf_config(cfg: ModelConfig) -> transformers.GlmMoeDsaConfig:
    d = cfg.to_hf_dict()
    d.pop("architectures")
    d.pop("model_type")
    return transformers.GlmMoeDsaConfig(**d)


def random_hf_model(cfg: ModelConfig, seed: int = 0, weight_std: float = 0.08,
                    bias_std: float = 0.1) -> transformers.GlmMoeDsaForCausalLM:
    """A float32 HF model with random weights, non-trivial norms and a nonzero correction bias.

    Weights are drawn wider than HF's 0.02 init so that logits, routing and indexer scores are
    well separated (parity then tests the math, not rounding noise).
    """
    torch.manual_seed(seed)
    model = transformers.GlmMoeDsaForCausalLM(hf_config(cfg)).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("k_norm.bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(weight_std * torch.randn_like(p))
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(bias_std * torch.randn_like(module.e_score_correction_bias))
    return model


def save_hf(model, path: str | os.PathLike) -> str:
    model.save_pretrained(os.fspath(path))
    return os.fspath(path)


def hf_logits_and_topk(model, input_ids: np.ndarray) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Logits [B,S,V] and each full layer's indexer top-k indices [B,S,K] from HF."""
    captured: dict[int, np.ndarray] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        indexer = layer.self_attn.indexer
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, out.numpy().copy())))
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(input_ids, dtype=torch.long)).logits.numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, captured


def causal_topk_sets(topk: np.ndarray) -> list[list[frozenset]]:
    """Per (batch, query) the set of selected keys that are causal (<= query index), ignoring -1."""
    b, s, _ = topk.shape
    return [[frozenset(int(x) for x in topk[bi, qi] if 0 <= x <= qi) for qi in range(s)] for bi in range(b)]
