"""Where plan mode compiles (`plan.target`), the GPU topology it compiles for, and the memory budget it judges
against. Imports no JAX (launch.py checks the target before JAX starts).

Targets: "cpu" compiles for virtual CPU devices (XLA:CPU; no time estimate: its kernels and buffers are
not a GPU's); "h20" / "h200" compile deviceless for CUDA with XLA's GPU compiler (`kernels.aot`, the `gpu-aot`
extra) and estimate each program's time per kernel (`kernel_cost`, with the rates of `efficiency`).
"""

from __future__ import annotations

from glm52_jax import choices

TARGETS = choices.PLAN_TARGETS
GPU_TARGETS = tuple(t for t in TARGETS if t != "cpu")
GPUS_PER_HOST = 8  # an HGX node
# The launcher sets XLA_PYTHON_CLIENT_MEM_FRACTION to this (unless set; launch/run_node.sh too): the share of each
# GPU's memory JAX preallocates, so the most any program may hold per device.
LAUNCHER_MEM_FRACTION = 0.90


ESTIMATE_NOTES = (
    "time (GPU targets): the per-kernel estimate of plan/kernel_cost.py with the efficiency table named in "
    "target.efficiency: every kernel the program launches costs max(FLOPs / (peak x its class's fraction), bytes / "
    "(HBM x its fraction), the launch floor) per execution, times its executions (known trip counts, and the trip "
    "counts plan/loop_trips.py derives from the model's block rules for its data-dependent loops, on the busiest "
    "device); + a host sync per data-dependent iteration; + collectives by kind and link (hierarchical all-gather / "
    "reduce-scatter / all-reduce, all-to-all by its cross-host share) at an achieved fraction of line rate plus a "
    "latency each; nothing overlapped. Three scenarios (optimistic / central / pessimistic) take each entry's "
    "value of that name; the EP exchange's passes are a stated parameter of each scenario",
    "first_candidate_s: every call of the prefill program (the whole prompt) + one decode call, per scenario: the "
    "seed's first candidate",
    "memory_bytes_executed: every kernel (fusion, custom call, copy, ...) reads its operands and writes its result "
    "once (a fusion parameter read only through slices counts the slices; an in-place dynamic-update-slice counts "
    "the update), times known trip counts; collectives are not in it",
)


def topology_for(devices: int) -> str:
    """The deviceless topology "hosts x 1 x GPUs per host" of a mesh of `devices` GPUs: whole hosts of
    GPUS_PER_HOST when they divide it (32 -> 4x1x8), else one host (N <= 8 -> 1x1xN)."""
    if devices > GPUS_PER_HOST and devices % GPUS_PER_HOST == 0:
        return f"{devices // GPUS_PER_HOST}x1x{GPUS_PER_HOST}"
    if devices <= GPUS_PER_HOST:
        return f"1x1x{devices}"
    raise ValueError(f"plan: {devices} GPUs are neither one host (<= {GPUS_PER_HOST}) nor whole hosts of "
                     f"{GPUS_PER_HOST}; pass topology='HOSTSx1xGPUS'")


def unavailable_message(target: str, missing: str | None) -> str | None:
    """The one-line config error for `target` when deviceless compiles lack `missing` (None: fine)."""
    if target not in GPU_TARGETS or missing is None:
        return None
    return (f"--config.plan.target={target}: compiling for the GPU deviceless needs the CUDA plugin ({missing}); "
            "install it with pip install -e '.[gpu-aot]', or plan on virtual CPU devices with "
            "--config.plan.target=cpu")


def check_target(target: str) -> None:
    """Raises `ConfigError` (before any compile) when `target` is a GPU and the plugin is missing."""
    from glm52_jax.run_config import ConfigError

    if target not in TARGETS:
        raise ConfigError(f"--config.plan.target={target}: must be one of {', '.join(TARGETS)}")
    if target in GPU_TARGETS:
        from glm52_jax.kernels import aot  # imports jax, which is fine before its backends start

        message = unavailable_message(target, aot.missing())
        if message:
            raise ConfigError(message)


def check_efficiency_table(path: str, target: str) -> None:
    """Raises `ConfigError` (before any compile) when a GPU plan's efficiency table (`plan.efficiency_table`;
    "" = the packaged one) is missing, malformed or has no entry for `target`."""
    from glm52_jax.plan.efficiency import TableError, load_table
    from glm52_jax.run_config import ConfigError

    if target not in GPU_TARGETS:
        return
    try:
        load_table(path or None).rates(target)
    except (TableError, ValueError) as err:
        raise ConfigError(f"--config.plan.efficiency_table={path or '(packaged)'}: {err}") from None


def budget_bytes(target: str, hbm_bytes: float, device_memory: int | None) -> float:
    """Per-device bytes a program may hold: a GPU target's memory times LAUNCHER_MEM_FRACTION, else
    `hbm_bytes` (`plan.hbm_gib`) for the CPU plan."""
    return device_memory * LAUNCHER_MEM_FRACTION if target in GPU_TARGETS else float(hbm_bytes)
