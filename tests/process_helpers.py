"""Several real launcher processes of one run on this machine: 4 CPU devices each, talking over gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.run_helpers import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_launchers(args: Sequence[Sequence[str]], logs: Path, *, cwds: Sequence[Path] | None = None,
                    env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """`python -m glm52_jax.launch *args[p]` as process p of one group (one process per entry of `args`),
    in `cwds[p]` (default the repository root), 4 CPU devices each unless `env` sets XLA_FLAGS; stdout/stderr of
    process p go to logs/p.out, logs/p.err."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank, extra in enumerate(args):
        penv = {**os.environ, "GLM52_COORDINATOR": f"127.0.0.1:{port}", "GLM52_NUM_PROCESSES": str(len(args)),
                "GLM52_PROCESS_ID": str(rank), "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=4", **(env or {})}  # `env` may replace any
        with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "glm52_jax.launch", *extra], env=penv, stdout=out,
                                          stderr=err, cwd=cwds[rank] if cwds else ROOT))
    return procs


def finish(procs: Sequence[subprocess.Popen], logs: Path, timeout: float = 900) -> list[tuple[int, str, str]]:
    """Waits for every process; (exit status, stdout, stderr) of each."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, (logs / f"{r}.out").read_text(), (logs / f"{r}.err").read_text())
            for r, p in enumerate(procs)]
