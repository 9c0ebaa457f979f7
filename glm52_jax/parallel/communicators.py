"""The collective communicators of a multi-process CPU run, opened once while every process is in step.

XLA:CPU's gloo collectives build a communicator the FIRST time a program runs a collective over a given list of
devices, and that build is a rendezvous through the coordinator's key-value store that gives the other processes
30 s to arrive (a fixed limit inside XLA). Processes of one run reach a program's first collective at different
times whenever one of them spends longer before it: a compile that one process reads from the persistent
compilation cache and the other compiles (JAX writes the cache from process 0 only, and on CPU process 1's keys
never match) was minutes of difference on the 2-process rehearsal parity (the parity programs compile in 100-330 s
on 2 cores). Past 30 s the early process fails with "Gloo context initialization failed: DEADLINE_EXCEEDED:
GetKeyValue() timed out" (2 runs of 2 with a warm cache, at the first all-device program). Multi-process CPU runs
now compile on every process (distributed.initialize turns the cache off) but any other delay (a slow disk, a
loaded host) meets the same limit. scripts/repro/gloo_first_use.py shows it without this project.

Once built, a communicator is kept for the process's life and reused by every later program over the same
devices, and a collective then waits for a late peer without that limit (XLA:CPU's own collective timeout is
30 min; the run's watchdog names a hang before that). So a multi-process CPU run opens them at start-up:
`open_all(mesh)` waits at a key-value barrier (no gloo, a generous deadline: the processes load the same things
before it) and then runs one small all-reduce over every combination of the mesh's non-trivial axes, the device
lists the run's programs reduce over (every program of a run over this mesh has its device assignment).

GPU runs are left as they are (NCCL communicators have their own set-up, not this limit); one process has none.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.sharding import Mesh

BARRIER_TIMEOUT_S = 600  # how long the first process waits for the last at the barrier before the build
_opened = [0]  # barriers passed by this process (each barrier id is used once)


def axis_groups(mesh: Mesh) -> list[tuple[str, ...]]:
    """Every non-empty combination of `mesh`'s axes larger than 1 (the device groups a program reduces over),
    e.g. ('context',), ('expert',), ('context', 'expert') for context=4 x expert=2; [] on one device."""
    axes = [name for name, size in mesh.shape.items() if size > 1]
    return [combo for k in range(1, len(axes) + 1) for combo in itertools.combinations(axes, k)]


def needed(mesh: Mesh | None) -> bool:
    """Whether this run must open its communicators up front: several processes on CPU (gloo)."""
    import jax

    return mesh is not None and jax.process_count() > 1 and mesh.devices.flat[0].platform == "cpu"


def open_all(mesh: Mesh | None, *, timeout_s: int = BARRIER_TIMEOUT_S) -> int:
    """Opens the gloo communicators of every axis group of `mesh` on every process (a collective: each process
    calls it at the same point); returns how many groups were opened (0 when `needed` is false)."""
    if not needed(mesh):
        return 0
    import jax
    import numpy as np
    from jax._src import distributed
    from jax.sharding import NamedSharding, PartitionSpec

    client = distributed.global_state.client
    if client is not None:  # every process here before any gloo rendezvous starts its 30 s
        _opened[0] += 1
        client.wait_at_barrier(f"glm52_open_communicators_{_opened[0]}", timeout_s * 1000)
    groups = axis_groups(mesh)
    # One element per device: x [devices of the mesh], laid out over every axis.
    spec = PartitionSpec(tuple(mesh.axis_names))
    ones = jax.make_array_from_callback((mesh.devices.size,), NamedSharding(mesh, spec),
                                        lambda index: np.ones((1,), np.float32))
    for group in groups:
        reduce = jax.shard_map(lambda x, g=group: jax.lax.psum(x, g), mesh=mesh, in_specs=spec, out_specs=spec)
        total = jax.jit(reduce)(ones)
        expected = int(np.prod([mesh.shape[a] for a in group]))
        got = float(np.asarray(total.addressable_data(0))[0])
        if got != expected:  # an all-reduce of ones over the group counts its devices
            raise RuntimeError(f"opening the communicators of mesh axes {group}: sum {got}, expected {expected}")
    return len(groups)
