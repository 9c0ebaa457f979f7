"""The processes of a multi-process run: who writes, what they must agree on, where they wait.

Every process runs the same program (SPMD) on its share of the mesh: it samples (the sampler's outputs
are replicated), scores and updates like the others. Process 0 alone writes the shared files
(config.json and the workdir lock, metrics.jsonl, receipts); every process writes its own trace and
completion record into the step's artifacts, which process 0 lists in the manifest after a barrier.
Orbax checkpoints are written by all of them together. The processes compare the sha256 of their
settings before anything is built, and of what they sampled before each update: a process that
differs stops the run on every process with a line naming it. One process: every call is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from glm52_jax.parallel import watchdog
from glm52_jax.run_config import ConfigError, RunSpec


class ProcessDivergenceError(RuntimeError):
    """Two processes of one run computed different samples or rewards (they must be replicas)."""


def count() -> int:
    import jax

    return jax.process_count()


def index() -> int:
    import jax

    return jax.process_index()


def is_writer() -> bool:
    """Whether this process writes the run's shared files (process 0)."""
    return index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (names must match across processes)."""
    if count() > 1:
        from jax.experimental import multihost_utils

        with watchdog.phase("barrier", program=f"sync_global_devices({name!r})"):
            multihost_utils.sync_global_devices(name)


def _gathered(values: np.ndarray) -> np.ndarray:
    """`values` of every process stacked: [P, ...] (the same on every process)."""
    from jax.experimental import multihost_utils

    with watchdog.phase("allgather", program="process_allgather"):
        return np.asarray(multihost_utils.process_allgather(values))


def differing(digest_hex: str) -> list[tuple[int, str]]:
    """(process, its digest) for every process whose sha256 `digest_hex` differs from process 0's."""
    if count() == 1:
        return []
    digests = _gathered(np.frombuffer(bytes.fromhex(digest_hex), np.uint8))  # [P, 32]
    return [(p, bytes(d).hex()) for p, d in enumerate(digests) if not np.array_equal(d, digests[0])]


def check_same_settings(spec: RunSpec) -> None:
    """Refuses to start unless every process has the same resumable settings (before any model work)."""
    wrong = differing(spec.resume_sha256())
    if wrong:
        names = ", ".join(f"process {p} ({d[:12]})" for p, d in wrong)
        raise ConfigError(f"the processes were started with different settings: {names} differ from process 0 "
                          f"({spec.resume_sha256()[:12]}); start every process with the same --config flags")


def check_same_samples(where: str, samples_bytes: bytes, rewards: Any) -> None:
    """Every process sampled the same tokens and computed the same rewards (`where`: e.g. "step 2
    candidate 1"). Checked after each candidate, before the rewards decide whether the search goes on
    (processes that decided differently would meet in different collectives and wait forever), and
    over the whole step's samples before the update."""
    import json

    digest = hashlib.sha256(samples_bytes + json.dumps(rewards, sort_keys=True).encode()).hexdigest()
    wrong = differing(digest)
    if wrong:
        names = ", ".join(f"process {p}" for p, _ in wrong)
        raise ProcessDivergenceError(f"{where}: {names} sampled other tokens or rewards than process 0 "
                                     f"(sha256 {wrong[0][1][:12]} vs {digest[:12] if is_writer() else '?'}); "
                                     "the processes must run the same code, data and devices kind")


def all_ok(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective: every process calls it at the same point)."""
    return count() == 1 or bool(_gathered(np.asarray([int(ok)], np.int32)).min())


@contextlib.contextmanager
def claim_run(spec: RunSpec, workdir: str | os.PathLike, command: Sequence[str]) -> Iterator[Path]:
    """`workdir.claim` by process 0 (the lock, the saved settings); the others wait for its outcome and
    stop with it when it fails, so no process is left waiting on a barrier its peer never reaches."""
    from glm52_jax.workdir import claim

    if count() == 1:
        with claim(spec, workdir, command) as path:
            yield path
        return
    with contextlib.ExitStack() as stack:
        error = None
        if is_writer():
            try:
                stack.enter_context(claim(spec, workdir, command))
            except ConfigError as e:
                error = e
        ok = all_ok(error is None)
        if error is not None:
            raise error
        if not ok:
            raise ConfigError(f"process 0 could not claim {workdir} (its error says why)")
        yield Path(workdir)


def completion_record(events: list[dict]) -> dict[str, Any]:
    """What this process ran in a step: its devices, its events by kind, each device's peak memory
    (None where the backend reports none, as XLA:CPU does)."""
    import collections

    import jax

    devices = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        devices.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                        "peak_bytes_in_use": stats.get("peak_bytes_in_use")})
    return {"process": index(), "processes": count(), "devices": devices,
            "events": dict(sorted(collections.Counter(e["event"] for e in events).items()))}
