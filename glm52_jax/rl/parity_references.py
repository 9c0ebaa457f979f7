"""Parity's independent references: the same gradients computed outside JAX, compared with ours per case and mode.

  torch     --config.parity.torch_reference=True: HF transformers' GlmMoeDsaForCausalLM + PEFT
            (glm52_jax.torch_bridge.torch_reference; the `parity` extra)
  megatron  --config.parity.megatron_reference=True: a megatron-core GPTModel with Megatron-Bridge's LoRA names
            (glm52_jax.torch_bridge.megatron_reference; the `parity` extra, megatron-core 0.19.2)

Each computes conventional and response_only (those of `parity.modes`) on the run's fixture, LoRA state and both
cases, float32 on the host, in one process. A pair is the reference's gradients, log-probs and loss against ours
in the same mode, measured by the seed's metrics (parity_metrics) and decided against the reference's bounds (a
contract of the issue that added it, not a setting). The receipt holds, per case, `cases.<case>.<name>` (pairs by
mode) and `<name>_acceptance` (the bounds).

Axis letters: G responses, R response tokens.
"""

from __future__ import annotations

import dataclasses
import importlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from glm52_jax.rl import parity_metrics, processes
from glm52_jax.run_config import ConfigError, RunSpec, parse_bound

MODES = ("conventional", "response_only")  # what a reference computes (shared_prefix is exact conventional)


@dataclasses.dataclass(frozen=True)
class Reference:
    name: str  # the receipt's key
    flag: str  # the ParitySpec field that turns it on
    what: str
    bounds: tuple[str, ...]
    modules: tuple[str, ...]  # imported to check the extra is installed


REFERENCES = (
    # HF + PEFT: the bounds (issue 19 item 6).
    Reference("torch", "torch_reference", "HF transformers GlmMoeDsaForCausalLM + PEFT",
              ("cosine >= 0.99999", "rel_l2 <= 1e-4", "logprob_abs <= 1e-5", "loss_abs <= 1e-5"),
              ("torch", "transformers", "peft")),
    # megatron-core: issue 34's bounds (the seed's metrics in float32).
    Reference("megatron", "megatron_reference", "megatron-core GPTModel with Megatron-Bridge LoRA",
              ("cosine >= 0.99999", "rel_l2 <= 1e-5", "logprob_abs <= 1e-5", "loss_abs <= 1e-5"),
              ("torch", "megatron.core")),
)


def enabled(spec: RunSpec) -> tuple[Reference, ...]:
    return tuple(r for r in REFERENCES if getattr(spec.parity, r.flag))


def check(spec: RunSpec) -> None:
    """Every enabled reference can run here: its packages import, and the run is one process."""
    for ref in enabled(spec):
        flag = f"--config.parity.{ref.flag}=True"
        try:
            # Imported here: the torch_bridge package imports torch, which a run without references never needs.
            from glm52_jax.torch_bridge.megatron_cpu import quiet

            with quiet():
                for module in ref.modules:
                    importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{flag} needs the `parity` extra ({', '.join(ref.modules)}): {e}; install with "
                              "`pip install -e .[parity]`") from None
        if processes.count() > 1:
            raise ConfigError(f"{flag} runs in one process (the reference model is built on its host); run parity "
                              "without it on several processes")


def _entry(ref: Reference) -> Callable:
    """The reference's function (torch_reference's signature); imported only when it runs."""
    if ref.name == "torch":
        from glm52_jax.torch_bridge import torch_reference

        return torch_reference
    from glm52_jax.torch_bridge.megatron_reference import megatron_reference

    return megatron_reference


def runs(spec: RunSpec, model, prompt, responses, mask, olds: dict[str, np.ndarray], advantages, loss_settings,
         log) -> dict[str, dict]:
    """{reference: {case: {mode: {"grads": {name: array}, "loss", "logprobs"}}}} for every enabled reference."""
    from flax import nnx

    out = {}
    modes = [m for m in MODES if m in spec.parity.modes]
    for ref in enabled(spec):
        compute, out[ref.name] = _entry(ref), {}
        with tempfile.TemporaryDirectory(prefix=f"glm52-parity-{ref.name}-") as scratch:
            for case, old in olds.items():
                result = compute(model, prompt, responses, mask, old, advantages, modes=modes, loss=loss_settings,
                                 scratch_dir=Path(scratch) / case)
                out[ref.name][case] = {
                    mode: {"grads": {"/".join(map(str, p)): np.asarray(v.get_value())
                                     for p, v in nnx.to_flat_state(r.grads)},
                           "loss": float(r.loss), "logprobs": np.asarray(r.logprobs)}
                    for mode, r in result.items()}
                log(f"parity {case}: {ref.name} reference of {', '.join(modes)} done")
    return out


def pairs(ref: Reference, ref_runs: dict[str, dict], ours: dict[str, dict], families, mask,
          outliers: int) -> dict[str, Any]:
    """One case's pairs of `ref` against ours (same mode): the seed's metrics and the decision on `ref.bounds`."""
    bounds = [parse_bound(b) for b in ref.bounds]
    out = {}
    for mode, theirs in ref_runs.items():
        metrics = parity_metrics.pair_metrics(
            theirs["grads"], ours[mode]["grads"], families, logprobs=theirs["logprobs"],
            ref_logprobs=ours[mode]["logprobs"], mask=mask, loss=theirs["loss"], ref_loss=ours[mode]["loss"],
            outliers=outliers)
        out[mode] = {**metrics, **parity_metrics.decide(metrics, bounds)}
    return out


def describe(spec: RunSpec, model) -> dict[str, Any]:
    """What each enabled reference is, for the receipt (beside its acceptance bounds)."""
    out = {}
    for ref in enabled(spec):
        record: dict[str, Any] = {"model": ref.what}
        if ref.name == "megatron":
            from glm52_jax.torch_bridge.megatron_reference import describe as describe_megatron

            record.update(describe_megatron(model))
        out[ref.name] = record
    return out
