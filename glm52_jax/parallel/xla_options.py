"""XLA options a run chooses, given to the GPU compiler the same way in plan mode and in the run.

Plan mode passes them per compile (`compiler_options`); a run sets them in `XLA_FLAGS` before JAX
starts its backend (`export_to_environ`), so every program the run compiles gets them.

`model.moe_cross_host`: how XLA:GPU implements the MoE's ragged all-to-all when its devices span hosts.
- "xla" (default, XLA's supported path): the multi-host decomposer. Each exchange all-gathers every
  device's send rows across the hosts (to the devices of the same local rank), then runs a ragged
  all-to-all within each host: a device receives (hosts - 1) x its peers' whole send buffers over the
  network, 4x the rows it needs on 4 hosts with balanced routing (plan of configs/2m.py: ~3.7 TB across
  hosts per prefill).
- "nccl": one ragged all-to-all of the exact rows, by NCCL send/recv. XLA calls this path a fallback
  and refuses it unless allowed; other JAX projects have reported hangs with it on jax 0.11 multi-GPU
  runs. Not run on hardware by this project.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CROSS_HOST_OPTIONS: dict[str, dict[str, bool]] = {
    "xla": {},
    "nccl": {"xla_gpu_unsupported_enable_ragged_all_to_all_multi_host_decomposer": False,
             "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback": True},
}


def cross_host_options(choice: str) -> dict[str, bool]:
    """The XLA options of a `model.moe_cross_host` choice."""
    if choice not in CROSS_HOST_OPTIONS:
        raise ValueError(f"moe_cross_host: expected one of {tuple(CROSS_HOST_OPTIONS)}, got {choice!r}")
    return dict(CROSS_HOST_OPTIONS[choice])


def as_flags(options: dict[str, bool | int | str]) -> list[str]:
    """`{name: value}` -> `--name=value` as XLA_FLAGS spells it (booleans lower case)."""
    return [f"--{name}={str(value).lower() if isinstance(value, bool) else value}" for name, value in options.items()]


def export_to_environ(options: dict[str, bool | int | str], environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds `options` to `environ["XLA_FLAGS"]` (before JAX starts). A flag the caller already set there wins:
    it is left as it is, so a person can override the run's choice on one machine."""
    flags = environ.get("XLA_FLAGS", "").split()
    given = {flag.split("=", 1)[0] for flag in flags}
    flags += [flag for flag in as_flags(options) if flag.split("=", 1)[0] not in given]
    if flags:
        environ["XLA_FLAGS"] = " ".join(flags)
