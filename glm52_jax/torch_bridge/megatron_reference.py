"""Conventional and response_only GRPO LoRA gradients from megatron-core, mapped back onto our LoRA tree.

    results = megatron_reference(model, prompt, responses, mask, old_logprobs, advantages,
                                 modes=("conventional", "response_only"), loss=LossSettings(), scratch_dir=tmp)
    results["conventional"].grads   # nnx.State shaped like nnx.state(model, LoRA): d(loss)/d(our adapters)

The same contract and semantics as `torch_bridge.gradients.torch_reference` (HF + PEFT), with the policy a
megatron-core GPTModel (`megatron_policy.py`; CPU workarounds in `megatron_cpu.py`):

  weights    our base and LoRA go through `checkpoint.megatron.to_megatron` (the local layout) into a safetensors
             file, read back with `load_megatron_state` and loaded by name into megatron's own modules.
  loss       verl's GRPO policy loss in torch, `torch_bridge.grpo.policy_loss` (the HF reference's code), over the
             [G,R] log-probs of the response tokens; one `backward`.
  gradients  the adapters' gradients under Megatron-Bridge's names, read back with
             `checkpoint.megatron.lora_from_megatron`, the exact inverse of `to_megatron`'s LoRA relayout. That
             relayout sends each of our elements to exactly one Megatron element and back (per-expert tensors,
             transposes, kv_b's rows per head, fc1's gate and up halves; unlike PEFT's fused routed experts, no
             Megatron element holds a constant), so it is a permutation: its inverse is its adjoint and carries
             the gradients unchanged (tests/torch_bridge/test_megatron_reference.py checks <E x, y> = <x, E^T y>).

Log-probs: position p predicts token p+1, the R log-probs of a response come from the logits at positions
P-1 .. P+R-2 of the inputs prompt + response[:-1] (`rl.gradients`' docstring).

  conventional   per sample one forward over prompt + response[:-1]; gradients through everything.
  response_only  the same forward with the prompt prefix as a constant cache: in every layer the absorbed key
                 [c_kv ; k_rope] (the normalised latent and the rotated RoPE key, what our and HF's caches hold)
                 of positions 0 .. P-2 enters DSAttention detached. The values are those of a cached run (causal:
                 those positions see only themselves), and the gradient flows through the sample's own positions
                 only, as in ours. The indexer needs nothing: DSAttention detaches its inputs and HF runs it under
                 no_grad, so its keys carry no gradient in any of the three. (megatron's KV cache belongs to its
                 inference engine, not to the training forward a Megatron trainer differentiates.)
  shared_prefix  is exact conventional: answered with the conventional computation.

Axis letters: P prompt tokens, G responses, R response tokens, V vocab.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from glm52_jax.checkpoint.megatron import load_megatron_state, lora_from_megatron, megatron_shapes, to_megatron
from glm52_jax.checkpoint.safetensors_io import write_safetensors
from glm52_jax.model.mla import latent_norm_eps
from glm52_jax.torch_bridge import grpo
from glm52_jax.torch_bridge.gradients import EXACT_ALIASES, TorchResult, check_inputs, target_logprobs
from glm52_jax.torch_bridge.megatron_policy import LOCAL_LAYOUT, adapter_gradients, build_policy

POLICY_FILE = "megatron_policy.safetensors"  # under the scratch directory: base + LoRA, Megatron names


def check_single_process() -> None:
    """The reference runs in one process (a mesh of that process's devices is fine)."""
    if jax.process_count() > 1:
        raise ValueError(f"the Megatron reference runs in one process, this run has {jax.process_count()}: run "
                         "--config.parity.megatron_reference=True without several processes (GLM52_NUM_PROCESSES=1)")


def write_policy(model, scratch_dir: str | os.PathLike) -> Path:
    """`model`'s base and LoRA as one Megatron state dict (local layout): `scratch_dir/megatron_policy.safetensors`."""
    check_single_process()
    path = Path(scratch_dir) / POLICY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, sorted(to_megatron(model, LOCAL_LAYOUT).items()))
    return path


def describe(model) -> dict:
    """The reference's settings as a parity receipt records them."""
    from importlib.metadata import version

    return {"megatron_core": version("megatron-core"), "torch": version("torch"),
            "layout": "local spec (megatron_cpu.py): SequentialMLP experts, unfused dense pre-MLP norm",
            "lora": "Megatron-Bridge CanonicalLoRA names, one adapter per linear and expert",
            "latent_norm_eps": latent_norm_eps(model.opts), "dsa_indexer_rotate_activation": False,
            "response_only": "prompt[:-1]'s absorbed MLA keys detached in every layer (a constant cache)"}


# ------------------------------------------------------------------------------------------------
# Log-probs of the response tokens (torch, differentiable).


def _logits(gpt, ids):
    """`ids: [S]` (torch long) -> the GPTModel's logits [S, V] (its own causal mask, positions 0 .. S-1)."""
    import torch

    positions = torch.arange(ids.shape[0])[None]
    return gpt(input_ids=ids[None], position_ids=positions, attention_mask=None)[0]


def conventional_logprobs(gpt, prompt, responses):
    """`prompt: [P]`, `responses: [G,R]` (torch long) -> [G,R]: per sample one forward, gradients through all."""
    import torch

    p = prompt.shape[0]
    return torch.stack([target_logprobs(_logits(gpt, torch.cat([prompt, r[:-1]]))[p - 1:], r) for r in responses])


def _constant_prefix_hook(n: int):
    """A DSAttention pre-hook detaching the absorbed key rows of positions < n (its second argument [S, B, 1, C+R])."""
    import torch

    def hook(module, args, kwargs):
        key = args[1]
        return (args[0], torch.cat([key[:n].detach(), key[n:]], dim=0), *args[2:]), kwargs

    return hook


def response_only_logprobs(gpt, prompt, responses):
    """`prompt: [P]`, `responses: [G,R]` -> [G,R]: as conventional, with the prefix prompt[:-1]'s cache entries
    constant in every layer (module docstring)."""
    hook = _constant_prefix_hook(prompt.shape[0] - 1)
    handles = [layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in gpt.decoder.layers]
    try:
        return conventional_logprobs(gpt, prompt, responses)
    finally:
        for handle in handles:
            handle.remove()


_LOGPROBS = {"conventional": conventional_logprobs, "response_only": response_only_logprobs}


# ------------------------------------------------------------------------------------------------
# The entry point.


def megatron_reference(model, prompt, responses, mask, old_logprobs, advantages, *, modes, loss,
                       scratch_dir) -> dict[str, TorchResult]:
    """The megatron-core reference of `glm52_jax.rl.gradients.lora_gradients` for each of `modes`.

    model: our GlmMoeDsa with LoRA (one process, on one device or a mesh; computed in float32). prompt: [P] int;
    responses: [G,R] int; mask: [G,R] (1 valid); old_logprobs: [G,R]; advantages: [G] (numpy).
    modes: a subset of ("conventional", "response_only", "shared_prefix"); shared_prefix is answered with the
    conventional computation (exact). loss: `rl.gradients.LossSettings`. scratch_dir: where the Megatron state
    dict of the policy is written.
    """
    prompt, responses = np.asarray(prompt), np.asarray(responses)
    mask, old_logprobs = np.asarray(mask, np.float32), np.asarray(old_logprobs, np.float32)
    advantages = np.asarray(advantages, np.float32)
    modes = check_inputs(prompt, responses, mask, old_logprobs, advantages, modes)
    if model.opts.lora is None:
        raise ValueError("the Megatron reference differentiates LoRA adapters: the model has none")
    # Outside any mesh context: the writer reads each array with small programs on the array's own devices.
    with jax.set_mesh(None):
        path = write_policy(model, scratch_dir)
    return _megatron_reference(model, load_megatron_state(path), prompt, responses, mask, old_logprobs, advantages,
                               modes, loss)


def _megatron_reference(model, sd, prompt, responses, mask, old_logprobs, advantages, modes,
                        loss) -> dict[str, TorchResult]:
    import torch

    from glm52_jax.torch_bridge.megatron_cpu import cpu_runtime

    prompt_t, responses_t = torch.as_tensor(prompt, dtype=torch.long), torch.as_tensor(responses, dtype=torch.long)
    mask_t, old_t, adv_t = (torch.from_numpy(np.array(a)) for a in (mask, old_logprobs, advantages))
    lora = model.opts.lora
    computed: dict[str, TorchResult] = {}
    with cpu_runtime():
        gpt = build_policy(model.cfg, sd, megatron_shapes(model, LOCAL_LAYOUT, base=False), scale=lora.scale,
                           latent_norm_eps=latent_norm_eps(model.opts))
        for mode in dict.fromkeys(EXACT_ALIASES.get(m, m) for m in modes):  # each computation once
            gpt.zero_grad(set_to_none=True)
            logprobs = _LOGPROBS[mode](gpt, prompt_t, responses_t)
            batch_loss = grpo.policy_loss(logprobs, old_t, adv_t, mask_t, loss)
            batch_loss.backward()
            grads = lora_from_megatron(adapter_gradients(gpt), model, LOCAL_LAYOUT)
            grads = nnx.from_flat_state([(p, v.replace(np.asarray(v.get_value(), np.float32)))
                                         for p, v in nnx.to_flat_state(grads)])
            computed[mode] = TorchResult(loss=float(batch_loss.detach()), logprobs=logprobs.detach().numpy().copy(),
                                         grads=grads)
    return {m: computed[EXACT_ALIASES.get(m, m)] for m in modes}
