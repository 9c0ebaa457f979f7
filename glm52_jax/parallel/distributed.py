"""Multi-host start-up: who is the coordinator, how many processes, which one is this.

Read from the environment, in this order:
1. `GLM52_COORDINATOR` (host:port), `GLM52_NUM_PROCESSES`, `GLM52_PROCESS_ID` — explicit, used by
   `launch/run_node.sh` and by the two-process CPU test;
2. SLURM (`SLURM_PROCID`, `SLURM_NTASKS`, first host of `SLURM_STEP_NODELIST`/`SLURM_JOB_NODELIST`,
   port `GLM52_COORDINATOR_PORT` or 12355) — one task per node, as `launch/slurm_4x8.sbatch` runs;
3. a Kubernetes Indexed Job's pod (a JobSet's workers are one; Kubernetes sets `JOB_COMPLETION_INDEX`) without
   the explicit variables: JAX's own Kubernetes bootstrap (`jax.distributed.initialize()` without arguments,
   the `k8s` extra = `jax[k8s]`; it asks the API server for the Job's pods, so the pod's service account
   needs read access to pods). `launch/k8s_jobset.yaml` sets the explicit variables instead (no API access);
4. nothing: a single process (no `jax.distributed` call at all).

On CPU the processes talk through gloo (`jax_cpu_collectives_implementation`), which is how
multi-host is tested on one machine: two processes x 4 virtual devices form one 8-device mesh.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

DEFAULT_PORT = 12355


class CoordinatorError(RuntimeError):
    """The process group cannot form at its coordinator address (one line naming the address)."""


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


def check_coordinator_port(group: ProcessGroup) -> None:
    """Process 0 serves the coordinator on the port of `group.coordinator`: when something on this host
    already listens there (another run, a leftover process), the JAX coordinator would crash the process
    (a segfault, rc 139) instead of saying so; raise `CoordinatorError` naming the address first."""
    import socket

    if group.process_id != 0:
        return
    port = int(group.coordinator.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT is no conflict
        try:
            probe.bind(("", port))
        except OSError as e:
            raise CoordinatorError(f"coordinator address {group.coordinator} ({group.source}): port {port} is in use "
                                   f"on this host ({e.strerror}); stop what holds it or choose another port") from None


def _join(group: ProcessGroup, timeout_s: int, heartbeat_s: int) -> None:
    """`jax.distributed.initialize`, its failure (a coordinator address held by something that is not
    process 0's coordinator, or no coordinator within the timeout) as one `CoordinatorError` line."""
    import jax

    try:
        jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.num_processes,
                                   process_id=group.process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_s)
    except Exception as e:  # XlaRuntimeError / RuntimeError from the coordination service client
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CoordinatorError(f"process {group.process_id} of {group.num_processes} could not join the coordinator "
                               f"at {group.coordinator} ({group.source}) within {timeout_s} s: {first}") from None


def kubernetes_job(env: Mapping[str, str] | None = None) -> bool:
    """This process is a pod of a Kubernetes Indexed Job (JobSet workers are one) and no explicit or SLURM
    variables describe the process group: JAX's Kubernetes bootstrap finds the group."""
    env = os.environ if env is None else env
    return "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env and from_env(env) is None


def _join_kubernetes(env: Mapping[str, str], timeout_s: int, heartbeat_s: int) -> ProcessGroup:
    """`jax.distributed.initialize()` without arguments (JAX's K8sCluster: the Job's pods from the API server,
    pod 0 the coordinator); a missing `kubernetes` package is one line naming both ways out, not JAX's warning
    followed by a single-process run that would then hang the other pods."""
    import importlib.util

    where = f"Kubernetes Job pod (JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']})"
    if importlib.util.find_spec("kubernetes") is None:
        raise CoordinatorError(f"{where} without GLM52_COORDINATOR: JAX's Kubernetes bootstrap needs the k8s extra "
                               "(pip install -e '.[k8s]'), or set GLM52_COORDINATOR, GLM52_NUM_PROCESSES and "
                               "GLM52_PROCESS_ID as launch/k8s_jobset.yaml does")
    import jax

    try:
        jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_s)
    except Exception as e:  # the API server refused (service account rights), or the pods never met
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CoordinatorError(f"{where} could not form the process group through JAX's Kubernetes bootstrap "
                               f"within {timeout_s} s: {first}") from None
    from jax._src import distributed as jax_distributed  # the address JAX chose; only for the progress lines

    address = getattr(jax_distributed.global_state, "coordinator_address", None) or "?"
    return ProcessGroup(address, jax.process_count(), jax.process_index(), "Kubernetes (jax[k8s])")


def initialize(env: Mapping[str, str] | None = None, *, timeout_s: int = 300,
               heartbeat_s: int = 100) -> ProcessGroup | None:
    """Joins the process group from the environment (no-op for a single process).

    `heartbeat_s` bounds how long a live process keeps waiting on a dead peer before it fails.
    """
    env = os.environ if env is None else env
    group = from_env(env)
    if group is None and kubernetes_job(env):
        return _join_kubernetes(env, timeout_s, heartbeat_s)
    if group is None or group.num_processes == 1:
        return group
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # No persistent compilation cache across CPU processes: JAX writes it from process 0 only, and process 1's
        # keys never match on CPU (they hash the topology of the process's own devices), so process 0 ran each
        # program minutes ahead of a peer that compiled it, and with executables read from the cache on one side and
        # compiled on the other, 2-process parity died in gloo ("Received data size doesn't match expected size ...
        # collective mismatch"; XLA:CPU tells the messages of a pair apart by order only, tag 0) or hung. Nor can
        # the processes share one compile: with equal keys (a group-wide topology hash) and JAX's binary sharing,
        # process 1 ran process 0's executable and the rehearsal failed the same way at its first update (an
        # XLA:CPU executable is specific to the process that compiled it; BUILD_NOTES.md, CI budget). Every
        # process compiles: the run takes as long as it did (process 1 compiled everything anyway).
        jax.config.update("jax_enable_compilation_cache", False)
    check_coordinator_port(group)
    _join(group, timeout_s, heartbeat_s)
    return group
