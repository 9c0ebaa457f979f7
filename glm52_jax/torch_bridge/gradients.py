"""Conventional and response_only GRPO LoRA gradients in torch, mapped back onto our LoRA tree.

    results = torch_reference(model, prompt, responses, mask, old_logprobs, advantages,
                              modes=("conventional", "response_only"), loss=LossSettings(), scratch_dir=tmp)
    results["conventional"].grads   # nnx.State shaped like nnx.state(model, LoRA): d(loss)/d(our adapters)

The semantics are those of `glm52_jax.rl.gradients` (its docstring): position p predicts token p+1, so the R
log-probs of a response come from the logits at positions P-1 .. P+R-2 of the inputs prompt + response[:-1].

  conventional   per sample one uncached forward over prompt + response[:-1]; gradients through everything.
  response_only  prompt[:-1] runs once under `torch.no_grad` (its cache holds no autograd graph: a constant);
                 each sample runs [prompt[-1]] + response[:-1] against its own copy of that cache, so the
                 gradient flows through the sample's own tokens only.
  shared_prefix  is exact conventional (it only reorganises the backward), so it is answered with the
                 conventional computation (the same result object when both are asked for).

The G per-sample forwards feed one [G,R] batch loss (`torch_bridge.grpo.policy_loss`), and one `backward`
runs back through each sample's graph once: the sum of the per-sample gradients, with the batch normalisers
written as verl writes them rather than split per sample as our JAX code does.

Back to our layout: every PEFT tensor is a relayout of our arrays (transposes, reshapes, the kv_b halves
concatenated, gate and up placed on the block diagonal of the fused gate_up adapter, one tensor per layer of a
stack) in which each of our elements lands in exactly one PEFT element and each PEFT element holds at most one
of ours. The gradient of such a relayout is the inverse relayout on the PEFT elements that hold ours (no sums
are needed; tests/torch_bridge/test_torch_gradients.py checks the adjoint identity <E x, y> = <x, E^T y> over
every family's tensors), and the PEFT elements that hold none (the off-diagonal blocks of gate_up's B, constant
zeros of our parametrisation) get gradients that are not ours and are dropped. So torch's LoRA gradients are
written as a PEFT adapter file and read back with `checkpoint.peft_load.load_peft_adapter`, the exact inverse
of the export.

Axis letters: P prompt tokens, G responses, R response tokens, V vocab, E experts, r rank, I expert intermediate.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from glm52_jax.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from glm52_jax.checkpoint.peft_load import load_peft_adapter
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from glm52_jax.model.lora import LoRA
from glm52_jax.torch_bridge import grpo
from glm52_jax.torch_bridge.policy import load_policy, write_policy

MODES = ("conventional", "response_only")
EXACT_ALIASES = {"shared_prefix": "conventional"}  # exact in our JAX code: answered by the torch conventional
GATE_UP_MODULE = ".mlp.experts.base_layer."  # peft's inner ParamWrapper on the fused routed experts: gate_up_proj


@dataclasses.dataclass(frozen=True)
class TorchResult:
    """One mode's torch reference: the batch loss, the new log-probs [G,R] of the response tokens and
    d(loss)/d(our LoRA arrays) as an `nnx.State` with the tree of `nnx.state(model, LoRA)` (numpy float32)."""

    loss: float
    logprobs: np.ndarray
    grads: nnx.State


# ------------------------------------------------------------------------------------------------
# Log-probs of the response tokens (torch, differentiable).


def target_logprobs(logits, targets):
    """`logits: [R,V]` at the positions predicting `targets: [R]` -> their log-probs [R]."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1)


def conventional_logprobs(policy, prompt, responses):
    """`prompt: [P]`, `responses: [G,R]` (torch long) -> [G,R]: per sample one uncached forward."""
    import torch

    p = prompt.shape[0]
    rows = []
    for response in responses:
        ids = torch.cat([prompt, response[:-1]])[None]
        logits = policy(input_ids=ids, use_cache=False).logits[0, p - 1:]
        rows.append(target_logprobs(logits, response))
    return torch.stack(rows)


def response_only_logprobs(policy, prompt, responses):
    """`prompt: [P]`, `responses: [G,R]` -> [G,R]: prompt[:-1] once without gradients, then per sample
    [prompt[-1]] + response[:-1] against a copy of that cache."""
    import torch

    with torch.no_grad():
        prefix = policy(input_ids=prompt[None, :-1], use_cache=True).cache
    rows = []
    for response in responses:
        ids = torch.cat([prompt[-1:], response[:-1]])[None]
        logits = policy(input_ids=ids, cache=copy.deepcopy(prefix), use_cache=True).logits[0]
        rows.append(target_logprobs(logits, response))
    return torch.stack(rows)


_LOGPROBS = {"conventional": conventional_logprobs, "response_only": response_only_logprobs}


# ------------------------------------------------------------------------------------------------
# torch's LoRA gradients -> our LoRA tree.


def peft_gradients(policy, rank: int) -> dict[str, np.ndarray]:
    """The LoRA gradients of the torch `policy` under the tensor names of the PEFT adapter file
    (`...lora_A.weight`), float32, restricted to the elements that hold our values (`ours_only`)."""
    out = {}
    for name, param in policy.named_parameters():
        if not param.requires_grad:
            continue
        adapter = name.split(".")[-2]  # "...lora_A.<adapter name>.weight"; the file has no adapter name
        grad = np.zeros(tuple(param.shape), np.float32) if param.grad is None else \
            param.grad.detach().numpy().astype(np.float32)
        out[name.replace(f".{adapter}.weight", ".weight")] = grad
    return ours_only(out, rank)


def ours_only(tensors: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """PEFT-layout tensors with the elements that hold none of our values set to zero: the gate/up cross
    blocks of the fused routed-expert gate_up B (constant zeros of our parametrisation); `rank`: our r."""
    return {n: _gate_up_block_diagonal(t, rank) if GATE_UP_MODULE in n and ".lora_B." in n else t
            for n, t in tensors.items()}


def _gate_up_block_diagonal(b: np.ndarray, rank: int) -> np.ndarray:
    """gate_up's `lora_B [2I, 2r*E]` (column k*E + e is expert e's column k, `checkpoint/peft._gate_up_b`) with
    the gate/up cross blocks zeroed: gate rows (< I) keep k < r, up rows (>= I) keep k >= r."""
    two_i, cols = b.shape
    k = np.arange(cols) // (cols // (2 * rank))  # [2r*E] the rank column each PEFT column holds
    gate_row = np.arange(two_i)[:, None] < two_i // 2
    return np.where(gate_row == (k[None, :] < rank), b, 0.0).astype(b.dtype)


def grads_to_ours(model, peft_grads: dict[str, np.ndarray], adapter_dir: Path, out_dir: Path) -> nnx.State:
    """Writes `peft_grads` as a PEFT adapter beside `adapter_dir`'s config and reads it back onto `model`'s
    LoRA tree (`load_peft_adapter`): d(loss)/d(our arrays) as numpy float32."""
    names = SafetensorsFile(adapter_dir / ADAPTER_WEIGHTS).keys()
    if sorted(names) != sorted(peft_grads):
        raise AssertionError(f"torch's LoRA tensors differ from the exported adapter's: "
                             f"{sorted(set(names) ^ set(peft_grads))[:4]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapter_dir / ADAPTER_CONFIG, out_dir / ADAPTER_CONFIG)
    write_safetensors(out_dir / ADAPTER_WEIGHTS, [(n, peft_grads[n]) for n in names])
    grads = nnx.state(load_peft_adapter(model, out_dir), LoRA)
    return nnx.from_flat_state([(p, v.replace(np.asarray(v.get_value(), np.float32)))
                                for p, v in nnx.to_flat_state(grads)])


# ------------------------------------------------------------------------------------------------
# The entry point.


def check_inputs(prompt, responses, mask, old_logprobs, advantages, modes) -> tuple[str, ...]:
    """The fixture's shapes and the modes asked for (both references); returns the modes as a tuple."""
    # The same checks as rl.gradients.check_inputs, written out: rl imports this package (parity), so this
    # package does not import rl.
    if prompt.ndim != 1 or prompt.shape[0] < 2:
        raise ValueError(f"prompt must be [P] token ids with P >= 2, got shape {prompt.shape}")
    if responses.ndim != 2 or responses.shape[1] < 1:
        raise ValueError(f"responses must be [G,R] token ids with R >= 1, got shape {responses.shape}")
    for name, a in (("mask", mask), ("old_logprobs", old_logprobs)):
        if a.shape != responses.shape:
            raise ValueError(f"{name} has shape {a.shape}, expected {responses.shape}")
    if advantages.shape != responses.shape[:1]:
        raise ValueError(f"advantages has shape {advantages.shape}, expected {responses.shape[:1]}")
    modes = tuple(modes)
    unknown = [m for m in modes if m not in MODES and m not in EXACT_ALIASES]
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES + tuple(EXACT_ALIASES)}, got {modes}")
    return modes


def torch_reference(model, prompt, responses, mask, old_logprobs, advantages, *, modes, loss,
                    scratch_dir) -> dict[str, TorchResult]:
    """The torch reference of `glm52_jax.rl.gradients.lora_gradients` for each of `modes`.

    model: our GlmMoeDsa with LoRA (float32; one process, on one device or a mesh). prompt: [P] int;
    responses: [G,R] int; mask: [G,R] (1 valid); old_logprobs: [G,R]; advantages: [G] (numpy).
    modes: a subset of ("conventional", "response_only", "shared_prefix"); shared_prefix is answered with
    the conventional computation (exact). loss: `rl.gradients.LossSettings`. scratch_dir: a directory this
    writes the base checkpoint, the adapter and the gradient adapters into.
    """
    prompt, responses = np.asarray(prompt), np.asarray(responses)
    mask, old_logprobs = np.asarray(mask, np.float32), np.asarray(old_logprobs, np.float32)
    advantages = np.asarray(advantages, np.float32)
    modes = check_inputs(prompt, responses, mask, old_logprobs, advantages, modes)
    # Outside any mesh context: the writers read each array with small programs on the array's own devices
    # (a replicated array from its first device), which an enclosing `jax.set_mesh` of several devices refuses.
    with jax.set_mesh(None):
        return _torch_reference(model, prompt, responses, mask, old_logprobs, advantages, modes, loss,
                                Path(os.fspath(scratch_dir)))


def _torch_reference(model, prompt, responses, mask, old_logprobs, advantages, modes, loss,
                     scratch_dir: Path) -> dict[str, TorchResult]:
    import torch

    base_dir, adapter_dir = write_policy(model, scratch_dir)
    policy = load_policy(base_dir, adapter_dir)
    prompt_t, responses_t = torch.as_tensor(prompt, dtype=torch.long), torch.as_tensor(responses, dtype=torch.long)
    mask_t, old_t, adv_t = (torch.as_tensor(a) for a in (mask, old_logprobs, advantages))
    computed: dict[str, TorchResult] = {}
    for mode in dict.fromkeys(EXACT_ALIASES.get(m, m) for m in modes):  # each torch computation once
        policy.zero_grad(set_to_none=True)
        logprobs = _LOGPROBS[mode](policy, prompt_t, responses_t)
        batch_loss = grpo.policy_loss(logprobs, old_t, adv_t, mask_t, loss)
        batch_loss.backward()
        peft_grads = peft_gradients(policy, model.opts.lora.rank)
        grads = grads_to_ours(model, peft_grads, adapter_dir, scratch_dir / f"grads_{mode}")
        computed[mode] = TorchResult(loss=float(batch_loss.detach()), logprobs=logprobs.detach().numpy().copy(),
                                     grads=grads)
    return {m: computed[EXACT_ALIASES.get(m, m)] for m in modes}
