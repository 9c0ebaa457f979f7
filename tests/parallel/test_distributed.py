"""Multi-host start-up: environment parsing, and two real local processes x 4 CPU devices (gloo)."""

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from glm52_jax.model.lora import LoRA
from glm52_jax.parallel.distributed import ProcessGroup, first_host, from_env
from tests.process_helpers import free_port

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


def _spawn(mode: str, heartbeat_s: int = 10, extra=()):
    port = free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, GLM52_COORDINATOR=f"127.0.0.1:{port}", GLM52_NUM_PROCESSES="2",
                   GLM52_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu", HEARTBEAT_S=str(heartbeat_s),
                   XLA_FLAGS="--xla_force_host_platform_device_count=4")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, *extra], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def test_two_processes_form_one_mesh():
    procs = _spawn("sum")
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    data = np.arange(8 * 6 * 5, dtype=np.float32).reshape(8, 6, 5) / 7.0
    for r in results:
        assert r["devices"] == 8 and r["local_devices"] == 4
        assert r["opened"] == 3  # context, expert, and both: every device group of the 4 x 2 mesh
        assert r["compilation_cache"] is False  # every CPU process compiles (distributed.initialize)
        np.testing.assert_allclose(r["total"], np.sum(np.tanh(data) * 3.0), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(r["gram"]), np.einsum("sij,skj->ik", data, data), rtol=1e-5)


# XLA:CPU builds a gloo communicator at a device list's first collective and gives the other processes 30 s to
# arrive (parallel/communicators.py); 40 s late is past it. ~50 s (both pairs run at once, mostly asleep): slow.
LATE_S = 40


@pytest.mark.slow
def test_a_process_late_to_the_first_collective_waits_once_the_communicators_are_open():
    """With the mesh's communicators opened at start-up, a process 40 s late to the first reduction is waited
    for and both sum; without, process 0 fails in XLA's 30 s communicator set-up (the limit open_all exists for:
    if XLA lifts it, this half fails and open_all may go)."""
    pairs = {how: _spawn("late", extra=(str(LATE_S), how)) for how in ("open", "closed")}
    outs = {how: [p.communicate(timeout=LATE_S + 240) for p in procs] for how, procs in pairs.items()}
    opened = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs["open"]]
    assert [r.get("total") for r in opened] == [28.0, 28.0], opened
    assert opened[0]["waited"] >= LATE_S - 1, opened  # process 0 waited in the collective for its late peer
    # Without: process 0 fails at 30 s (its late peer is then aborted by JAX's coordination service).
    closed = json.loads(outs["closed"][0][0].strip().splitlines()[-1])
    assert "Gloo context initialization failed" in closed.get("error", ""), outs["closed"]


# The survivor learns of the dead peer from the coordination service once the peer has missed its
# heartbeats for HEARTBEAT_S (measured: ~10-15 s after the death, on this 2-core machine under load).
HEARTBEAT_S = 10
ABORT_BOUND_S = 45


# JAX's own abort, the backstop behind the launcher's peer watch (tests/rl/test_rehearsal.py kills a process in CI).
@pytest.mark.slow
def test_a_dead_peer_fails_the_survivor_in_bounded_time():
    procs = _spawn("die", heartbeat_s=HEARTBEAT_S)
    try:
        outs = [p.communicate(timeout=ABORT_BOUND_S + 60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    survivor_done = time.time()
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0, "the survivor must not hang or succeed"
    died_at = json.loads(outs[1][0].strip().splitlines()[-1])["died_at"]
    after_death = survivor_done - died_at
    print(f"survivor exited with {procs[0].returncode} {after_death:.1f} s after its peer died "
          f"(heartbeat timeout {HEARTBEAT_S} s)")
    assert after_death <= ABORT_BOUND_S, after_death
    # The coordination service names the cause: the peer stopped sending heartbeats.
    assert "stopped sending heartbeats" in outs[0][1], outs[0][1][-3000:]


# ~80 s, slow for CI's budget; in CI two processes form one mesh above, run whole training steps and are killed and
# resumed in tests/rl/test_rehearsal.py, and export a model in tests/rl/test_export_processes.py.
@pytest.mark.slow
def test_two_processes_run_a_sharded_forward_and_training_step(tmp_path):
    """2 processes x 4 devices (context 4 x expert 2 across both) vs the same step on one device."""
    out_file = tmp_path / "sharded.npz"
    procs = _spawn("train", extra=[str(out_file)])
    sys.path.insert(0, str(WORKER.parent))
    import multiprocess_worker

    # The single-device reference runs while the two processes do (their pipes drained meanwhile).
    with ThreadPoolExecutor(len(procs)) as pool:
        pending = [pool.submit(p.communicate, timeout=600) for p in procs]
        model, batch = multiprocess_worker.training_problem()
        # The adapters before the step (train_step updates the model in place; its old arrays stay as they are).
        before = {f"lora:{'/'.join(map(str, k))}": np.asarray(v.get_value())
                  for k, v in nnx.to_flat_state(nnx.state(model, LoRA))}
        single = multiprocess_worker.train_step(model, batch)
        outs = [f.result() for f in pending]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    sharded = dict(np.load(out_file))
    assert sorted(sharded) == sorted(single)
    assert sum(k.startswith("lora:") for k in single) > 10
    for key, want in single.items():
        got = sharded[key]
        assert got.shape == want.shape, key
        if key.startswith(("lora:", "grad:")):  # compared below as arrays
            continue
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=key)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    grad_err = {k: rel(sharded[k], single[k]) for k in single if k.startswith("grad:")}
    print(f"2-process vs single-device: logits max |diff| {np.abs(sharded['logits'] - single['logits']).max():.1e}, "
          f"worst per-array gradient rel-L2 {max(grad_err.values()):.1e}")
    assert max(grad_err.values()) <= 1e-5
    # The optimizer step applied on the mesh is exactly AdamW's first step (clip to norm 1, then
    # -lr * g / (|g| + eps)) of the mesh's own gradients. (Compared with the single-device step
    # instead, elements with |g| near eps amplify last-bit gradient differences: 3e-5 rel-L2.)
    grads = {k[5:]: sharded[k].astype(np.float64) for k in sharded if k.startswith("grad:")}
    norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    np.testing.assert_allclose(float(sharded["grad_norm"]), norm, rtol=1e-5)
    for key, old in before.items():
        g = grads[key[5:]] * min(1.0, 1.0 / norm)
        want = old - 1e-2 * g / (np.abs(g) + 1e-8)
        assert np.linalg.norm(want - old) > 0, key
        assert rel(sharded[key] - old, want - old) <= 1e-5, key


def test_a_coordinator_port_in_use_is_one_line_naming_the_address():
    """Process 0 on a port something already listens on: `CoordinatorError` naming the address, before
    JAX's coordinator would crash the process (rc 139); other processes do not serve the port."""
    from glm52_jax.parallel.distributed import CoordinatorError, check_coordinator_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(CoordinatorError, match=rf"^coordinator address 127.0.0.1:{port} \(GLM52_\*\): port {port} "
                                                   r"is in use on this host \(.*\); stop what holds it or choose"):
            check_coordinator_port(ProcessGroup(f"127.0.0.1:{port}", 2, 0, "GLM52_*"))
        check_coordinator_port(ProcessGroup(f"127.0.0.1:{port}", 2, 1, "GLM52_*"))
    check_coordinator_port(ProcessGroup(f"127.0.0.1:{port}", 2, 0, "GLM52_*"))  # released: free again


def test_a_kubernetes_job_pod_without_the_explicit_variables_uses_jax_bootstrap_or_says_what_is_missing():
    """An Indexed Job's pod (Kubernetes sets JOB_COMPLETION_INDEX) with no GLM52_* / SLURM variables is JAX's
    Kubernetes bootstrap's; explicit variables still win. Without the `kubernetes` package (the k8s extra) the
    join is one line naming the extra and the explicit variables, instead of a silent single-process run."""
    import importlib.util

    from glm52_jax.parallel.distributed import CoordinatorError, initialize, kubernetes_job

    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}
    assert kubernetes_job(pod)
    assert not kubernetes_job({"KUBERNETES_SERVICE_HOST": "10.0.0.1"})  # a plain pod: one process
    explicit = {**pod, "GLM52_COORDINATOR": "pod-0.svc:12355", "GLM52_NUM_PROCESSES": "4", "GLM52_PROCESS_ID": "3"}
    assert not kubernetes_job(explicit)
    if importlib.util.find_spec("kubernetes") is not None:
        pytest.skip("the kubernetes package is installed: the bootstrap would call the API server")
    with pytest.raises(CoordinatorError, match=r"^Kubernetes Job pod \(JOB_COMPLETION_INDEX=3\) without "
                       r"GLM52_COORDINATOR: .*pip install -e '\.\[k8s\]'.*GLM52_PROCESS_ID"):
        initialize(pod)
