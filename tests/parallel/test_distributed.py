"""Multi-host start-up: environment parsing, and two real local processes x 4 CPU devices (gloo)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from glm52_jax.parallel.distributed import ProcessGroup, first_host, from_env

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def test_explicit_environment():
    env = {"GLM52_COORDINATOR": "10.0.0.1:1234", "GLM52_NUM_PROCESSES": "4", "GLM52_PROCESS_ID": "3"}
    assert from_env(env) == ProcessGroup("10.0.0.1:1234", 4, 3, "GLM52_*")
    assert from_env({}) is None


def test_slurm_environment():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "h20-[07-10]"}
    assert from_env(env) == ProcessGroup("h20-07:12355", 4, 2, "SLURM")
    assert first_host("gpu[3,5-6],cpu1") == "gpu3" and first_host("node12") == "node12"


@pytest.mark.parametrize("env,match", [
    ({"GLM52_COORDINATOR": "host", "GLM52_NUM_PROCESSES": "2", "GLM52_PROCESS_ID": "0"}, "host:port"),
    ({"GLM52_COORDINATOR": "h:1", "GLM52_NUM_PROCESSES": "2", "GLM52_PROCESS_ID": "2"}, "not in"),
    ({"GLM52_COORDINATOR": "h:1", "GLM52_NUM_PROCESSES": "two", "GLM52_PROCESS_ID": "0"}, "integer"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "NODELIST"),
])
def test_bad_environment(env, match):
    with pytest.raises(ValueError, match=match):
        from_env(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(mode: str, heartbeat_s: int = 10):
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, GLM52_COORDINATOR=f"127.0.0.1:{port}", GLM52_NUM_PROCESSES="2",
                   GLM52_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu", HEARTBEAT_S=str(heartbeat_s),
                   XLA_FLAGS="--xla_force_host_platform_device_count=4")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def test_two_processes_form_one_mesh():
    procs = _spawn("sum")
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    data = np.arange(8 * 6 * 5, dtype=np.float32).reshape(8, 6, 5) / 7.0
    for r in results:
        assert r["devices"] == 8 and r["local_devices"] == 4
        np.testing.assert_allclose(r["total"], np.sum(np.tanh(data) * 3.0), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(r["gram"]), np.einsum("sij,skj->ik", data, data), rtol=1e-5)


def test_a_dead_peer_fails_the_survivor_in_bounded_time():
    start = time.perf_counter()
    procs = _spawn("die", heartbeat_s=10)
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed = time.perf_counter() - start
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0, "the survivor must not hang or succeed"
    assert elapsed < 240
    # The coordination service names the cause: the peer stopped sending heartbeats.
    assert "stopped sending heartbeats" in outs[0][1], outs[0][1][-3000:]
    print(f"survivor exited with {procs[0].returncode} after {elapsed:.1f} s")
