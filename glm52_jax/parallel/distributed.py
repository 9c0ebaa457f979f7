"""Multi-host start-up: who is the coordinator, how many processes, which one is this.

Read from the environment, in this order:
1. `GLM52_COORDINATOR` (host:port), `GLM52_NUM_PROCESSES`, `GLM52_PROCESS_ID` — explicit, used by
   `launch/run_node.sh` and by the two-process CPU test;
2. SLURM (`SLURM_PROCID`, `SLURM_NTASKS`, first host of `SLURM_STEP_NODELIST`/`SLURM_JOB_NODELIST`,
   port `GLM52_COORDINATOR_PORT` or 12355) — one task per node, as `launch/slurm_4x8.sbatch` runs;
3. nothing: a single process (no `jax.distributed` call at all).

On CPU the processes talk through gloo (`jax_cpu_collectives_implementation`), which is how
multi-host is tested on one machine: two processes x 4 virtual devices form one 8-device mesh.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

DEFAULT_PORT = 12355


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str  # host:port of process 0
    num_processes: int
    process_id: int
    source: str  # "GLM52_*" or "SLURM"


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: `gpu[07-10,12],cpu3` -> `gpu07`."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def from_env(env: Mapping[str, str] | None = None) -> ProcessGroup | None:
    """The process group the environment describes, or None for a single process."""
    env = os.environ if env is None else env
    if "GLM52_COORDINATOR" in env:
        group = ProcessGroup(env["GLM52_COORDINATOR"], _int(env, "GLM52_NUM_PROCESSES"),
                             _int(env, "GLM52_PROCESS_ID"), "GLM52_*")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURM_PROCID is set but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is")
        port = _int(env, "GLM52_COORDINATOR_PORT") if "GLM52_COORDINATOR_PORT" in env else DEFAULT_PORT
        group = ProcessGroup(f"{first_host(nodelist)}:{port}", _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"),
                             "SLURM")
    else:
        return None
    if ":" not in group.coordinator:
        raise ValueError(f"coordinator address must be host:port, got {group.coordinator!r} ({group.source})")
    if group.num_processes < 1 or not 0 <= group.process_id < group.num_processes:
        raise ValueError(f"process id {group.process_id} is not in [0, {group.num_processes}) ({group.source})")
    return group


def default_to_cpu_without_a_gpu() -> None:
    """JAX_PLATFORMS=cpu when unset and the machine has no NVIDIA driver: the CUDA plugin (the gpu-aot
    extra, for deviceless compiles) would otherwise print a failed-cuInit traceback at start-up."""
    if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidiactl"):
        os.environ["JAX_PLATFORMS"] = "cpu"


def initialize(env: Mapping[str, str] | None = None, *, timeout_s: int = 300,
               heartbeat_s: int = 100) -> ProcessGroup | None:
    """Joins the process group from the environment (no-op for a single process).

    `heartbeat_s` bounds how long a live process keeps waiting on a dead peer before it fails.
    """
    group = from_env(env)
    if group is None or group.num_processes == 1:
        return group
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.num_processes,
                               process_id=group.process_id, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=heartbeat_s)
    return group
