"""Virtual devices for plan mode: enough (CPU) devices for the mesh, set up before JAX starts.

Imports no JAX at module level: `ensure_virtual_devices` must be able to run before JAX reads
`XLA_FLAGS` / `JAX_PLATFORMS` (launch.py calls it first thing in `--mode=plan`).
"""

from __future__ import annotations

import os
import re
import sys

FORCE_FLAG = "--xla_force_host_platform_device_count"


def ensure_virtual_devices(n: int) -> int:
    """Makes this process see at least `n` devices, as virtual CPU devices if it must.

    Before JAX's backends start: sets `XLA_FLAGS=--xla_force_host_platform_device_count=n` (other
    XLA flags kept) and `JAX_PLATFORMS=cpu` (plus the matching `jax.config` values when jax is
    already imported, since jax reads those variables at import) unless they already provide
    `n` CPU devices. After they started: checks the count and raises a RuntimeError saying how to
    fix it if it is short. Returns the number of devices the process has or will have.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"ensure_virtual_devices: expected a positive integer, got {n!r}")
    jax_mod = sys.modules.get("jax")
    if jax_mod is not None and _backends_initialized():
        have = jax_mod.device_count()
        if have < n:
            raise RuntimeError(
                f"plan needs {n} devices but JAX is already initialised with {have} "
                f"({jax_mod.default_backend()}); virtual devices can only be added before JAX starts: call "
                f"glm52_jax.plan.ensure_virtual_devices({n}) before any JAX computation, or run with "
                f"XLA_FLAGS={FORCE_FLAG}={n} JAX_PLATFORMS=cpu")
        return have
    flags = os.environ.get("XLA_FLAGS", "")
    current = re.search(rf"{FORCE_FLAG}=(\d+)", flags)
    if current and int(current.group(1)) >= n and os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return int(current.group(1))
    kept = [f for f in flags.split() if not f.startswith(FORCE_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{FORCE_FLAG}={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    if jax_mod is not None:  # imported but not started: its config already read the environment
        jax_mod.config.update("jax_platforms", "cpu")
        jax_mod.config.update("jax_num_cpu_devices", n)
    return n


def check_device_count(mesh_spec) -> None:
    """Raises a ValueError saying how to get the devices when this process has fewer than the mesh."""
    import jax

    have = jax.device_count()
    if have < mesh_spec.size:
        raise ValueError(f"plan: mesh {mesh_spec.describe()} needs {mesh_spec.size} devices but this process has "
                         f"{have} ({jax.default_backend()}); call glm52_jax.plan.ensure_virtual_devices("
                         f"{mesh_spec.size}) before JAX starts, or set XLA_FLAGS={FORCE_FLAG}={mesh_spec.size} "
                         "JAX_PLATFORMS=cpu")


def _backends_initialized() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()
