"""Our policy as a trainable HF transformers + PEFT model in torch (float32, CPU).

The base goes through `checkpoint.hf.save_pretrained` and the adapters through
`checkpoint.peft.save_peft_adapter`, the very files `--mode=export` writes, so the torch model holds the
same weights and LoRA values by construction; HF `GlmMoeDsaForCausalLM.from_pretrained` and
`peft.PeftModel.from_pretrained(is_trainable=True)` read them back in float32.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

from glm52_jax.checkpoint.hf import save_pretrained
from glm52_jax.checkpoint.peft import save_peft_adapter

BASE_DIR = "base"  # under the scratch directory: the HF checkpoint of the base weights
ADAPTER_DIR = "adapter"  # the PEFT adapter (adapter_config.json + adapter_model.safetensors)


def check_single_process() -> None:
    """The reference runs in one process (a mesh of that process's devices is fine)."""
    if jax.process_count() > 1:
        raise ValueError(f"the torch reference runs in one process, this run has {jax.process_count()}: run "
                         "--config.parity.torch_reference=True without several processes (GLM52_NUM_PROCESSES=1)")


def write_policy(model, scratch_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Writes `model`'s base (HF checkpoint) and LoRA (PEFT adapter) under `scratch_dir`; returns both dirs."""
    check_single_process()
    scratch_dir = Path(scratch_dir)
    base, adapter = scratch_dir / BASE_DIR, scratch_dir / ADAPTER_DIR
    save_pretrained(model, base)
    save_peft_adapter(model, adapter)
    return base, adapter


def load_policy(base: str | os.PathLike, adapter: str | os.PathLike):
    """HF `GlmMoeDsaForCausalLM` (float32, eager attention) with the PEFT adapter attached, trainable:
    only the LoRA tensors require gradients. Raises if any checkpoint tensor is missing or left over."""
    import peft
    import torch
    import transformers

    hf, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        os.fspath(base), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"HF did not load the base checkpoint {base} exactly: {problems}")
    with warnings.catch_warnings():
        # peft checks rank/alpha_pattern keys against module names only; ours name the fused routed-expert
        # parameter (mlp.experts.gate_up_proj) and are applied there (checkpoint/peft.py's docstring).
        warnings.filterwarnings("ignore", message=".*_pattern keys did not match any targeted module")
        policy = peft.PeftModel.from_pretrained(hf, os.fspath(adapter), is_trainable=True)
    policy.eval()  # no dropout; gradients still flow
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    if not trainable or any(".lora_" not in n for n in trainable):
        raise AssertionError(f"expected only LoRA tensors to be trainable, got {trainable[:5]}")
    return policy


def torch_policy(model, scratch_dir: str | os.PathLike):
    """`model` (our GlmMoeDsa with LoRA) as a trainable torch HF + PEFT model, via files in `scratch_dir`."""
    return load_policy(*write_policy(model, scratch_dir))
