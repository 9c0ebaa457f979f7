"""Where plan mode compiles (`plan.target`), the GPU topology it compiles for, and the speeds its
modeled time assumes. Imports no JAX (launch.py checks the target before JAX starts).

Targets: "cpu" compiles for virtual CPU devices (XLA:CPU; no modeled time: its buffers and FLOPs are
not a GPU's); "h20" / "h200" compile deviceless for CUDA with XLA's GPU compiler
(`kernels.aot`, the `gpu-aot` extra) and model each program's time from the speeds below.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from glm52_jax import choices

TARGETS = choices.PLAN_TARGETS
GPU_TARGETS = tuple(t for t in TARGETS if t != "cpu")
GPUS_PER_HOST = 8  # an HGX node
# launch/run_node.sh exports XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 (unless set): the share of each GPU's
# memory JAX preallocates, so the most any program may hold per device.
LAUNCHER_MEM_FRACTION = 0.90


@dataclasses.dataclass(frozen=True)
class Speeds:
    """Peak rates of one GPU of a target; every modeled time is bytes or FLOPs over one of these."""

    flops_per_s: float  # dense bf16 tensor-core peak
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # NVLink 4, per GPU and direction (900 GB/s bidirectional)
    network_bytes_per_s: float  # inter-host, per GPU: the host's NICs shared by its GPUS_PER_HOST GPUs
    source: str
    # Fixed cost of one collective (launch + synchronisation), whatever its size: what a step of many small
    # collectives (a decode step's tensor-parallel projections) pays. Assumed, typical NCCL small-message figures.
    nvlink_latency_s: float = 10e-6
    network_latency_s: float = 30e-6


# ../shared/research/performance_rooflines.md §1 (H20: 148 TFLOPS bf16 dense, 4.0 TB/s; H200: 989.5 TFLOPS,
# 4.8 TB/s; NVLink 900 GB/s bidirectional on both). The H20 cluster's network is not known: 4 x 400 Gb/s
# per host is assumed (25 GB/s per GPU); the H200's 8 x 400 Gb/s per host (one NIC per GPU, 50 GB/s).
SPEEDS = {
    "h20": Speeds(148e12, 4.0e12, 450e9, 4 * 400e9 / 8 / GPUS_PER_HOST,
                  "H20: 148 TFLOPS bf16 dense, HBM 4.0 TB/s, NVLink 450 GB/s per direction, inter-host "
                  "4 x 400 Gb/s per host (assumed) = 25 GB/s per GPU; 10 / 30 us per collective within / across "
                  "hosts (assumed)"),
    "h200": Speeds(989.5e12, 4.8e12, 450e9, 8 * 400e9 / 8 / GPUS_PER_HOST,
                   "H200: 989.5 TFLOPS bf16 dense, HBM 4.8 TB/s, NVLink 450 GB/s per direction, inter-host "
                   "8 x 400 Gb/s per host (assumed) = 50 GB/s per GPU; 10 / 30 us per collective within / across "
                   "hosts (assumed)"),
}

MODEL_NOTES = (
    "modeled time per program call (GPU targets): compute = (flops_executed + indexer_flops_analytic) / bf16 "
    "peak; memory = memory_bytes_executed / HBM bandwidth; communication = collective bytes within a host / NVLink "
    "+ collective bytes across hosts / the per-GPU inter-host rate + a fixed latency per collective executed (by "
    "link); modeled = max(compute, memory) + communication (no overlap of communication with work assumed)",
    "memory_bytes_executed: every kernel (fusion, custom call, copy, ...) reads its operands and writes its result "
    "once (a fusion parameter read only through slices counts the slices; an in-place dynamic-update-slice counts "
    "the update), times known trip counts; collectives are not in it",
    "collective bytes are result-shape bytes (see above), all taken over the slower link a collective's groups "
    "span: an upper bound for a ring all-gather, whose per-device traffic is (n-1)/n of it",
    "FLOPs inside Pallas kernels (custom calls) are in flops_executed only where the kernel declares them in its "
    "name (sparse MLA, grouped matmul); the DSA indexer's scores sit in data-dependent key loops (counted once by "
    "the HLO): indexer_flops_analytic adds them per program (the program's query / visible-key pairs x "
    "2 * index heads * index head dim per 'full' layer, split evenly over the sequence shards)",
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


def budget_bytes(target: str, hbm_bytes: float, device_memory: int | None) -> float:
    """Per-device bytes a program may hold: a GPU target's memory times LAUNCHER_MEM_FRACTION, else
    `hbm_bytes` (`plan.hbm_gib`) for the CPU plan."""
    return device_memory * LAUNCHER_MEM_FRACTION if target in GPU_TARGETS else float(hbm_bytes)


def modeled_time(entry: dict[str, Any], speeds: Speeds) -> dict[str, float]:
    """{compute_s, memory_s, communication_s, modeled_s} of one program call from its measured entry."""
    traffic = entry["traffic"]
    flops = entry["flops"]["flops_executed"] + entry["flops"].get("indexer_flops_analytic", 0.0)
    compute = flops / speeds.flops_per_s
    memory = traffic["memory_bytes_executed"] / speeds.hbm_bytes_per_s
    communication = (traffic["collective_bytes_executed_within_host"] / speeds.nvlink_bytes_per_s
                      + traffic["collective_bytes_executed_across_hosts"] / speeds.network_bytes_per_s
                      + traffic.get("collectives_executed_within_host", 0) * speeds.nvlink_latency_s
                      + traffic.get("collectives_executed_across_hosts", 0) * speeds.network_latency_s)
    return {"compute_s": compute, "memory_s": memory, "communication_s": communication,
            "modeled_s": max(compute, memory) + communication}


def speeds_record(target: str) -> dict[str, Any]:
    """The assumed speeds as the report lists them."""
    return dataclasses.asdict(SPEEDS[target])
