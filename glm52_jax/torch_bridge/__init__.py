"""A PyTorch reference of our GRPO LoRA gradients (gradient parity, DESIGN's bridge for these checks only).

Imported only by parity code and tests; it needs the `parity` extra (torch, transformers, peft), which
the training path never imports. The same policy runs in torch on HF transformers' `GlmMoeDsaForCausalLM`
(float32, CPU) with our LoRA values attached through the PEFT adapter our export writes (`policy`), the
GRPO policy loss is written in torch from verl's semantics (`grpo`), and `gradients.torch_reference`
computes the conventional and response_only gradients and maps them back onto our LoRA tree.
`megatron_reference` computes the same with the policy as a megatron-core GPTModel (`megatron_policy`,
`megatron_cpu`; megatron-core 0.19.2 from the same extra), imported only where it runs.
"""

from glm52_jax.torch_bridge.gradients import TorchResult, torch_reference

__all__ = ["TorchResult", "torch_reference"]
